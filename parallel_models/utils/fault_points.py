"""Test-only fault injection: named points in the trainer, its checkpoint saves and its final HF
export where a process can SIGKILL itself, so that a chaos test's kills land exactly inside a
window (no polling of the file system, no timing) on however loaded a machine.

Off unless the environment variable ``PARALLEL_MODELS_TEST_FAULT`` is set (no config key, no
command-line option reaches it); when it is unset a point costs one ``os.environ`` lookup.
``PARALLEL_MODELS_TEST_FAULT=<point>[@<n>]`` kills the process the ``n``-th time (default 1) it
passes ``<point>``: it writes ``fault point <point>@<n>: SIGKILL`` on stderr, then
``os.kill(os.getpid(), SIGKILL)``. Hits are counted per process, so in a multi-rank run every
rank that passes the point dies; points only rank 0 passes (the rename of a checkpoint, its
``latest`` file) kill rank 0 alone. An unknown point name is a ``ConfigError`` at the first
point passed, so a typo cannot turn a chaos test into one without kills.
"""

from __future__ import annotations

import os
import signal

from parallel_models.errors import ConfigError

ENV = "PARALLEL_MODELS_TEST_FAULT"

POINTS = {
    # trainer start-up (rl/trainer.py)
    "start:before_resume": "roles built, the checkpoint not yet read",
    "start:after_resume": "the checkpoint loaded, the rollout not yet told of the weights",
    # one PPO step (rl/trainer.py)
    "step:after_rollout": "the step's responses generated, nothing scored",
    "step:mid_update": "the critic updated, the actor not yet",
    "step:after_metrics_logged": "the step's metrics line written, its checkpoint not begun",
    # a trainer checkpoint save (rl/checkpointing.py)
    "save:temp_created": "stale temporary folders removed, the new one created and empty",
    "save:after_tensor_data": "models and optimizer states written into the temporary folder, "
                              "RNG / trainer state / checksums not yet",
    "save:before_rename": "the temporary folder complete with its checksums, not yet renamed",
    "save:after_rename_before_latest": "step_N published, ``latest`` still names the step before",
    "save:after_latest_before_prune": "``latest`` names step_N, older checkpoints not yet pruned",
    # the final HF export (rl/trainer.py, llama/checkpoint_utils/saver.py, rl/final_export.py)
    "export:start": "the last checkpoint saved, stale exports removed, nothing exported",
    "hf_save:before_publish": "save_pretrained's temporary folder complete, not yet renamed (in "
                              "the trainer's export: hit 1 actor_hf, hit 2 critic_hf)",
    "export:before_record": "actor_hf / critic_hf published, final_export.json not written",
}

_hits: dict[str, int] = {}
_parsed: dict[str, tuple[str, int]] = {}


def parse_fault(spec: str) -> tuple[str, int]:
    """``"<point>[@<n>]"`` -> (point, n); a ConfigError naming the variable when malformed."""
    if spec not in _parsed:
        point, _, count = spec.partition("@")
        if point not in POINTS:
            raise ConfigError(f"{ENV}={spec!r}: unknown fault point {point!r}; known: "
                              + ", ".join(POINTS))
        try:
            n = int(count) if count else 1
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"{ENV}={spec!r}: the hit count after '@' must be an integer >= 1")
        _parsed[spec] = (point, n)
    return _parsed[spec]


def fault_point(name: str) -> None:
    """Pass the point ``name`` (one of :data:`POINTS`); dies here when the environment variable
    ``PARALLEL_MODELS_TEST_FAULT`` asks for it, else does nothing."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, n = parse_fault(spec)
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == n:
        os.write(2, f"fault point {name}@{n}: SIGKILL\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["ENV", "POINTS", "fault_point", "parse_fault"]
