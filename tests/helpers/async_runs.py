"""Workers of the async RL tests (run on gloo ranks): a short PPO run at ``trainer.mode=async``
or ``sync``, returning every step's metrics (timings aside), validation included at the steps of
``trainer.test_freq`` as the trainer's loop runs it. (A gloo rank is a daemonic process:
it cannot fork the test server, so the tests start it and pass ``rollout.server_url``.)"""

from __future__ import annotations

from tests.helpers.hybrid_ppo_runs import SHORT_RUN

QUIET = ["trainer.save_every=0", "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false"]


def ppo_run(output_dir: str, overrides: list[str], steps: int | None = None,
            save_after: int = 0, resume: bool = False, hook=None) -> dict:
    """The run of ``SHORT_RUN + QUIET + overrides`` for ``steps`` steps (default all):
    ``{"metrics": [...], "checkpoint": path | None, "step": int}``; ``save_after``: save a
    checkpoint after that many steps; ``resume``: from the latest checkpoint first; ``hook``:
    ``hook(trainer)`` before the first step (a test's instrumentation)."""
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    over = [f"trainer.output_dir={output_dir}", *SHORT_RUN, *QUIET, *overrides]
    if resume:
        over.append("trainer.resume=true")
    cfg = load_config(None, over)
    cfg.validate()
    trainer = PPOTrainer(cfg)
    out = {}
    try:
        if hook is not None:
            out["hook"] = hook(trainer)
        metrics, checkpoint = [], None
        left = cfg.trainer.total_steps - trainer.step_index
        for _ in range(steps if steps is not None else left):
            m = trainer.step()
            test_freq, last = cfg.trainer.test_freq, trainer.step_index == cfg.trainer.total_steps
            if trainer.validator is not None and test_freq and (
                    trainer.step_index % test_freq == 0 or last):  # (PPOTrainer.train's rule)
                m.update(trainer.validate_phase())
            metrics.append({k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))})
            if save_after and trainer.step_index == save_after:
                checkpoint = trainer.save_checkpoint()
    finally:
        close = getattr(trainer.rollout, "close", None)
        if close is not None:
            close()
    return {**out, "metrics": metrics, "checkpoint": checkpoint, "step": trainer.step_index}


def hold_pushes_until_queued(trainer) -> None:
    """Slow the trainer down (a test-only hook): each weight push waits until the producer has
    queued the next ``max_staleness`` steps (or those left), all drawn under older weights, so
    every step trains on samples exactly ``min(step, k)`` versions old: the bound is reached,
    never passed."""
    import time

    rollout = trainer.rollout
    push, k = rollout.update_weights, rollout.max_staleness
    total = trainer.cfg.trainer.total_steps

    def held(version):
        producer = rollout.producer
        want = min(k, total - int(version))
        while producer is not None and producer.ready() < want:
            time.sleep(0.005)
        push(version)

    rollout.update_weights = held
