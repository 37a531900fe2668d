"""The FP8 decode tuner's second pass: a few of its runners-up compared inside the captured
decode step.

``decode_tuning`` times each decode GEMM config alone: no dependent launch, no weight prefetch,
the L2 flushed, nothing before or after it. The graph runs it otherwise: the kernel before it is
still ending when its programs start prefetching, and the kernel after it starts on the SMs its
last programs leave idle. So the fastest config alone is not always the fastest in the step.
On an H100 (8B, 64 rows) the o_proj's 128-row weight-first tiles (32 programs) timed fastest
alone and took 12.1 us a layer in the graph, against 9.7 us for unsplit 32-row strips; 16-row
strips in 2 K splits took 18.1 us (docs/PERFORMANCE.md, session 21).

:func:`refine` runs after ``generation.capture_cuda_graph`` captured a step whose eager run
tuned new keys (``decode_tuning.fresh``; of those, the ones this step asked for,
``decode_tuning.used``). For each such key, largest weight first, it captures
the step again with each of the key's ``decode_tuning.alternatives`` in its place (the fastest
runners-up, and the fastest config of each other kind: tokens first or not, split along K or
not). It replays the current graph and the new one in turn (CUDA events, :data:`ROUNDS` each,
medians) and keeps the new one when it is faster by more than :data:`MARGIN` of the step. The
kept config becomes the key's choice (``decode_tuning.settle``), so later captures use it too.
Each comparison is recorded in :data:`graph_timings`.

The pass is on by default (``PARALLEL_MODELS_FP8_GRAPH_TUNING=0`` turns it off). On an H100
(8B, 64 rows, session 23) it made 13 comparisons in 2.0 s of the engine's start, kept new
configs for three of the four linears and took the decode step from 4.749 to 4.683 ms
(0.676x to 0.667x the bf16 step, alternated in one process; docs/PERFORMANCE.md). It runs only
where the step's graph has no collective in it (:func:`collective_free`: one rank, or
megatron's tensor, pipeline and expert groups of one rank each): its captures and replays
would have to happen in the same order on every rank of a tensor-parallel group, and each
rank decides from its own timings. While it is off the configs timed fastest alone run and
the keys stay fresh, so a later capture with the pass on still compares them:
``bench/fp8_decode.py --decode-kernels tma+nographtuning tma`` times the step both ways in one
process (the contender without the pass first: the pass's verdicts stay for the process).
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from parallel_models.inference.fp8 import decode_tuning

log = logging.getLogger(__name__)

ENV = "PARALLEL_MODELS_FP8_GRAPH_TUNING"
ROUNDS = 7  # replays of each graph, in turn
MARGIN = 0.002  # an alternative is kept when its step is faster by more than this fraction

graph_timings: list = []
"""``(key, config, its step ms, the current step ms, kept)`` of every comparison made."""
alone_choices: dict = {}
"""key -> the config timed fastest alone, for each key the pass looked at."""
seconds = 0.0
"""Wall time the pass took in this process (its captures and replays: an engine's start)."""


def collective_free() -> bool:
    """Whether this rank's decode step has no collective in it: torch.distributed not started
    or of one rank, or megatron's tensor, pipeline and expert parallel groups all of one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    try:
        from megatron.core import parallel_state as ps

        return bool(ps.model_parallel_is_initialized()) and \
            ps.get_tensor_model_parallel_world_size() == 1 and \
            ps.get_pipeline_model_parallel_world_size() == 1 and \
            ps.get_expert_model_parallel_world_size() == 1
    except (ImportError, AssertionError, RuntimeError):  # (no megatron groups: assume some)
        return False


def enabled() -> bool:
    """Whether :func:`refine` compares configs: on unless ``PARALLEL_MODELS_FP8_GRAPH_TUNING=0``,
    and only where the step is :func:`collective_free` (see the module docstring)."""
    return os.environ.get(ENV, "1") != "0" and collective_free()


def replay_ms(graphs: list, rounds: int = ROUNDS) -> list[float]:
    """Median milliseconds of each graph's replay; the graphs are replayed in turn, so a drift
    of the clock meets them all alike."""
    for graph in graphs:  # (first replays: caches, clocks)
        graph.replay()
    times: list = [[] for _ in graphs]
    events = []
    for _ in range(rounds):
        for i, graph in enumerate(graphs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events.append((i, start, end))
    torch.cuda.synchronize()
    for i, start, end in events:
        times[i].append(start.elapsed_time(end))
    return [statistics.median(t) for t in times]


def refine(capture, graph, output, time_graphs=replay_ms):
    """``(graph, output)``: the given capture of the step, or the capture with the configs that
    made it faster (see the module docstring). ``capture()`` runs the step eagerly once (it
    compiles a config's kernels as the graph launches them) and captures it again, returning
    ``(graph, output)``; ``time_graphs(graphs)`` -> each graph's step in ms. The caller
    cleared ``decode_tuning.used`` before its eager run (the keys of this step)."""
    if not enabled():  # (the keys stay fresh: a later capture with the pass on compares them)
        return graph, output
    fresh, in_step = decode_tuning.fresh, decode_tuning.used
    keys = [k for k in fresh if k in in_step and decode_tuning.alternatives.get(k)]
    fresh[:] = [k for k in fresh if k not in in_step]  # (e.g. a prefill's: a later capture's)
    if not keys:
        return graph, output
    keys.sort(key=lambda k: -k[1] * k[2])  # (out x in: the largest weights first)
    global seconds
    began = time.perf_counter()
    for key in keys:
        current = alone_choices[key] = decode_tuning.chosen_configs()[key]
        for alt in decode_tuning.alternatives[key]:
            decode_tuning.settle(key, alt)
            try:
                new_graph, new_output = capture()
                now_ms, new_ms = time_graphs([graph, new_graph])
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory for a second graph
                log.warning("fp8 decode GEMM %s: the step with %s did not capture or replay "
                            "(%s); kept %s", key, alt, exc, current)
                decode_tuning.settle(key, current)
                continue
            kept = new_ms < now_ms * (1 - MARGIN)
            graph_timings.append((key, alt, new_ms, now_ms, kept))
            if kept:
                graph, output, current = new_graph, new_output, alt
            del new_graph, new_output
            decode_tuning.settle(key, current)
        log.info("fp8 decode GEMM %s: %s in the step's graph", key, current)
    seconds += time.perf_counter() - began
    return graph, output


__all__ = ["ENV", "MARGIN", "ROUNDS", "alone_choices", "collective_free", "enabled",
           "graph_timings", "refine", "replay_ms", "seconds"]
