"""Which code holds a training run's GPU memory, step after step: a launcher that records the
stack of every live CUDA allocation (PyTorch's ``torch.cuda.memory._record_memory_history``,
state only: no event trace) and, after each PPO step, writes the live memory grouped by the code
that allocated it, one JSON line per step and rank, plus what grew since the step before.

    torchrun --nproc-per-node 2 bench/memory_trace.py --out DIR [--device-mib 81559] \\
        -m parallel_models.rl.train key=value ...
    python bench/grpo_scale.py --layout pp2 --memory-trace DIR ...   # the same, from the bench

Why: the 8B PP=2 GRPO run (docs/PERFORMANCE.md, session 15) allocates 128 MiB more outside its
KV pool at every step, only on CUDA. A group is the allocation's innermost frame in
``parallel_models`` (else the innermost frame outside torch) and the frame that called it:
``DIR/rank<R>.jsonl`` lines ``{"step", "live_gib", "groups": [[where, GiB, blocks], ...],
"grew": [[where, +GiB], ...]}`` (the 25 largest groups, every group that grew by >= 1 MiB). The
output is JSON (no pickle): PyTorch's own snapshot viewer is not needed to read it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

TOP_GROUPS = 25
GREW_MIB = 1.0
OURS = "parallel_models"


def where(frames: list[dict]) -> str:
    """The group of an allocation from its stack (innermost first): the innermost frame in our
    package (else the innermost outside torch), with the frame that called it."""
    def label(frame):
        name = frame.get("filename", "?")
        short = name[name.rfind(OURS):] if OURS in name else os.path.basename(name)
        return f"{short}:{frame.get('line', '?')}:{frame.get('name', '?')}"

    for i, frame in enumerate(frames):
        if OURS in frame.get("filename", ""):
            return " <- ".join(label(f) for f in frames[i:i + 2])
    for i, frame in enumerate(frames):
        if "/torch/" not in frame.get("filename", ""):
            return " <- ".join(label(f) for f in frames[i:i + 2])
    return "(no Python frame)"


def live_groups(snapshot: dict) -> dict[str, list]:
    """``where -> [bytes, blocks]`` of every live allocation of a
    ``torch.cuda.memory._snapshot()`` (its segments' ``active_allocated`` blocks; those in a
    private pool, a CUDA graph's, tagged)."""
    groups: dict[str, list] = {}
    for segment in snapshot.get("segments", []):
        pool = tuple(segment.get("segment_pool_id") or (0, 0))
        tag = "" if pool == (0, 0) else " [private pool: a CUDA graph's]"
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            entry = groups.setdefault(where(block.get("frames", [])) + tag, [0, 0])
            entry[0] += int(block.get("size", 0))  # (as the allocator counts it: rounded)
            entry[1] += 1
    return groups


def step_line(step: int, groups: dict, before: dict | None) -> dict:
    """One step's JSON line: the largest groups and those grown since ``before``."""
    gib = 2 ** 30
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    grew = []
    if before is not None:
        for key, (size, _) in groups.items():
            delta = size - before.get(key, [0, 0])[0]
            if delta >= GREW_MIB * 2 ** 20:
                grew.append([key, round(delta / gib, 4)])
        grew.sort(key=lambda kv: -kv[1])
    return {"step": step, "live_gib": round(sum(v[0] for v in groups.values()) / gib, 4),
            "groups": [[k, round(v[0] / gib, 4), v[1]] for k, v in ranked[:TOP_GROUPS]],
            "grew": grew}


def install(out: str) -> None:
    """Record live allocations' stacks and write a line per PPO step to ``out/rank<R>.jsonl``."""
    import torch

    if not torch.cuda.is_available():
        return
    from parallel_models.rl import trainer as trainer_module

    torch.cuda.memory._record_memory_history(enabled="state", context="alloc", stacks="python")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"rank{os.environ.get('RANK', '0')}.jsonl")
    state = {"before": None}
    step = trainer_module.PPOTrainer.step

    def traced_step(self):
        metrics = step(self)
        torch.cuda.synchronize()
        groups = live_groups(torch.cuda.memory._snapshot())
        with open(path, "a") as f:
            f.write(json.dumps(step_line(self.step_index, groups, state["before"])) + "\n")
        state["before"] = groups
        return metrics

    trainer_module.PPOTrainer.step = traced_step


def main() -> None:
    argv = sys.argv[1:]
    usage = "usage: memory_trace.py --out DIR [--device-mib MIB] -m MODULE [ARGS...]"
    if len(argv) < 4 or argv[0] != "--out":
        sys.exit(usage)
    out, rest = argv[1], argv[2:]
    if rest[:1] == ["--device-mib"]:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from device_envelope import apply

        apply(int(rest[1]))
        rest = rest[2:]
    if len(rest) < 2 or rest[0] != "-m":
        sys.exit(usage)
    install(out)
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
