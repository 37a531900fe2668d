"""Workers for the sampled-rollout layout tests (run on gloo ranks): a short sampled PPO run at a
layout, returning every step's metrics and the tokens drawn for each prompt of the global batch
(by its place in the batch), optionally saving a checkpoint or resuming one first."""

from __future__ import annotations

from tests.helpers.hybrid_ppo_runs import SHORT_RUN

# the hybrid tests' short run, sampled: 3 steps, 4 prompts x 2 samples, 6 new tokens, fp32 CPU
SAMPLED_RUN = [o for o in SHORT_RUN if not o.startswith("rollout.greedy")] + [
    "rollout.greedy=false", "rollout.temperature=1.0", "trainer.save_every=0",
    "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false"]


def _record_tokens(trainer, tokens: list) -> None:
    """Wrap ``trainer.rollout_phase``: append, per step, {global prompt index: [the token ids
    (prompt + response) of each of its samples]} for this rank's prompts."""
    orig = trainer.rollout_phase
    n = trainer.cfg.rollout.n

    def recording():
        batch = orig()
        mine = [i for i in range(trainer.cfg.data.batch_size)
                if i % trainer.dp_size == trainer.dp_rank]
        seqs, mask = batch.sequences.cpu(), batch.attention_mask.cpu().bool()
        rows = [seqs[r][mask[r]].tolist() for r in range(seqs.shape[0])]
        tokens.append({i: rows[k * n:(k + 1) * n] for k, i in enumerate(mine)})
        return batch

    trainer.rollout_phase = recording


def sampled_run(output_dir: str, layout: list[str], steps: int = 3, save_after: int = 0,
                resume_from: str | None = None, extra: tuple = (),
                validate: bool = False) -> dict:
    """``steps`` PPO steps (after resuming ``resume_from``, if given) at ``layout``:
    ``{"metrics": [...], "tokens": [...], "checkpoint": path | None, "continuous": bool}``;
    ``save_after``: save a checkpoint after that many steps; ``validate``: then a validation
    pass too (``"validation"``: its metrics and logged samples)."""
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={output_dir}", *SAMPLED_RUN, *layout, *extra])
    cfg.validate()
    trainer = PPOTrainer(cfg)
    if resume_from is not None:
        trainer.resume(resume_from)
    tokens: list = []
    _record_tokens(trainer, tokens)
    metrics, checkpoint = [], None
    for _ in range(steps):
        m = trainer.step()
        metrics.append({k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))})
        if save_after and trainer.step_index == save_after:
            checkpoint = trainer.save_checkpoint()
    validation = None
    if validate:
        logged: list = []
        trainer.metrics.log_samples = lambda step, rows: logged.extend(rows)
        val = trainer.validate_phase()
        validation = {"metrics": {k: v for k, v in val.items() if not k.startswith("timing/")},
                      "samples": logged}
    engine = getattr(trainer.rollout, "engine", None)
    return {"metrics": metrics, "tokens": tokens, "checkpoint": checkpoint,
            "validation": validation,
            "step": trainer.step_index, "continuous": bool(getattr(engine, "continuous", False))}


def merged_tokens(ranks: list[dict]) -> list[dict]:
    """Every rank's recorded tokens merged per step (the ranks of one DP replica must agree)."""
    steps = len(ranks[0]["tokens"])
    out = []
    for s in range(steps):
        merged: dict = {}
        for r in ranks:
            for i, rows in r["tokens"][s].items():
                assert merged.setdefault(i, rows) == rows, f"step {s + 1} prompt {i}: ranks differ"
        out.append(dict(sorted(merged.items())))
    return out
