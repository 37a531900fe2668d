"""The FP8 decode tuner's second pass (``inference/fp8/graph_tuning.py``), on the CPU with stand-ins
for the graphs: the runners-up ``decode_tuning`` keeps (the fastest agreeing configs and the
fastest of each other kind), and ``refine`` keeping, key by key, the config whose captured step
replays fastest, only by more than its margin, the choice settled for later captures."""

import pytest
import torch

from parallel_models.inference.fp8 import decode_tuning as dt
from parallel_models.inference.fp8 import graph_tuning as gt

CUDA = torch.device("cuda", 0)


def _cfg(block_n, split_k=1, tokens_first=False):
    return dt.DecodeConfig(block_n, 64, 128, split_k, 4, 4, tokens_first)


def test_runners_up_are_the_fastest_and_one_of_each_other_kind():
    wf, wf2, wf_split, tf_split, tf, tf_b, bad = (
        _cfg(128), _cfg(64), _cfg(64, 2), _cfg(16, 2, True), _cfg(32, 1, True),
        _cfg(16, 1, True), _cfg(256))
    results = [(bad, 0.9), (wf, 1.0), (wf2, 1.1), (wf_split, 1.2), (tf_split, 1.3), (tf, 1.4),
               (tf_b, 1.5)]
    checked = []

    def run(cfg):
        checked.append(cfg)
        return torch.full((2, 3), 5.0 if cfg == bad else 1.0)  # bad computes something else

    got = dt._agreeing(results, wf, run)
    assert got == [wf, wf2, wf_split, tf_split, tf]  # 2 fastest, then a config of each kind
    assert tf_b not in checked  # (its kind already had a config: not even run)
    assert dt._agreeing([], wf, run) == [wf]


@pytest.fixture
def tuned(monkeypatch):
    """Two tuned keys with their choices and runners-up, as choose() leaves them."""
    big, small = dt.key_of(64, 28672, 4096, "channel", CUDA, "tma"), \
        dt.key_of(64, 4096, 4096, "channel", CUDA, "tma")
    a, b, c = _cfg(128), _cfg(32, 1, True), _cfg(16, 2, True)
    monkeypatch.setattr(dt, "_chosen", {big: a, small: a})
    monkeypatch.setattr(dt, "alternatives", {big: [b], small: [b, c]})
    monkeypatch.setattr(dt, "fresh", [small, big])
    monkeypatch.setattr(dt, "used", {small, big})  # (the step asked for both)
    monkeypatch.setattr(gt, "graph_timings", [])
    monkeypatch.setattr(gt, "alone_choices", {})
    monkeypatch.setenv(gt.ENV, "1")
    return big, small, a, b, c


def _stand_ins(step_us):
    """capture() -> a "graph" (the choices it was captured with) and its output; the step time
    of a graph: the sum of ``step_us`` over its keys' configs."""
    captures = []

    def capture():
        graph = dict(dt.chosen_configs())
        captures.append(graph)
        return graph, ("output", len(captures))

    def time_graphs(graphs):
        return [sum(step_us[k][c] for k, c in g.items()) / 1e3 for g in graphs]

    return captures, capture, time_graphs


def test_refine_keeps_the_fastest_step_key_by_key(tuned):
    big, small, a, b, c = tuned
    captures, capture, time_graphs = _stand_ins({big: {a: 1500.0, b: 1400.0},
                                                  small: {a: 387.0, b: 310.0, c: 580.0}})
    first = capture()
    graph, output = gt.refine(capture, *first, time_graphs=time_graphs)
    assert dt.chosen_configs() == {big: b, small: b} and graph == {big: b, small: b}
    assert output == ("output", 3)  # the capture with both choices: big's first, then small's
    assert [(k, cfg, kept) for k, cfg, _, _, kept in gt.graph_timings] == \
        [(big, b, True), (small, b, True), (small, c, False)]
    assert dt.fresh == [] and len(captures) == 4 and gt.alone_choices == {big: a, small: a}
    assert gt.refine(capture, graph, output, time_graphs=time_graphs) == (graph, output)
    assert len(captures) == 4  # nothing fresh: nothing captured again


def test_refine_keeps_the_current_choice_within_the_margin(tuned):
    big, small, a, b, c = tuned
    step = 1887.0
    near = step * (1 - gt.MARGIN / 2)  # faster, but by less than the margin
    captures, capture, time_graphs = _stand_ins({big: {a: 1500.0, b: 1500.0 - (step - near)},
                                                  small: {a: 387.0, b: 400.0, c: 390.0}})
    first = capture()
    assert gt.refine(capture, *first, time_graphs=time_graphs) == first
    assert dt.chosen_configs() == {big: a, small: a}
    assert not any(kept for *_, kept in gt.graph_timings) and len(gt.graph_timings) == 3


def test_refine_compares_only_the_keys_of_the_step_it_captured(tuned):
    big, small, a, b, c = tuned
    other = dt.key_of(512 // 2, 4096, 4096, "channel", CUDA, "tma")  # (e.g. a prefill's)
    dt.fresh.append(other)
    dt.alternatives[other], dt._chosen[other] = [b], a
    dt.used.discard(big)
    captures, capture, time_graphs = _stand_ins({big: {a: 1.0, b: 0.5},
                                                  small: {a: 2.0, b: 1.0, c: 3.0},
                                                  other: {a: 1.0, b: 0.5}})
    gt.refine(capture, *capture(), time_graphs=time_graphs)
    assert dt.chosen_configs() == {big: a, small: b, other: a}
    assert dt.fresh == [big, other]  # left for the capture of a step that asks for them


def test_refine_off_and_a_failed_capture(tuned, monkeypatch):
    big, small, a, b, c = tuned
    captures, capture, time_graphs = _stand_ins({big: {a: 1.0, b: 0.5},
                                                  small: {a: 1.0, b: 0.5, c: 0.1}})
    monkeypatch.setenv(gt.ENV, "0")
    first = capture()
    assert not gt.enabled()
    assert gt.refine(capture, *first, time_graphs=time_graphs) == first
    assert dt.fresh == [small, big] and dt.chosen_configs() == {big: a, small: a}  # for later
    monkeypatch.setenv(gt.ENV, "1")
    dt.fresh[:] = [big]

    def failing():
        raise torch.OutOfMemoryError("no room for a second graph")

    assert gt.refine(failing, *first, time_graphs=time_graphs) == first
    assert dt.chosen_configs()[big] == a and gt.graph_timings == []
    dt.fresh[:] = [big]

    def failing_replay(graphs):
        raise RuntimeError("replay failed")

    assert gt.refine(capture, *first, time_graphs=failing_replay) == first
    assert dt.chosen_configs()[big] == a and gt.graph_timings == []


def test_on_by_default_only_where_the_step_has_no_collective(monkeypatch):
    """The pass is on unless switched off, and only on a rank whose decode graph runs no
    collective: each rank would capture and replay on its own timings, and a tensor-parallel
    step's all-reduces must pair up across ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    monkeypatch.delenv(gt.ENV, raising=False)
    assert gt.enabled()  # (no process group: one rank)
    monkeypatch.setenv(gt.ENV, "0")
    assert not gt.enabled()
    monkeypatch.delenv(gt.ENV)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    assert not gt.enabled()  # (ranks, but no megatron groups to tell what they share)
    sizes = {"tensor": 1, "pipeline": 1, "expert": 1}
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    for name in sizes:
        monkeypatch.setattr(ps, f"get_{name}_model_parallel_world_size",
                            lambda name=name: sizes[name])
    assert gt.enabled()  # (data parallel only: each rank's step is its own)
    for name in sizes:
        sizes[name] = 2
        assert not gt.enabled(), name
        monkeypatch.setenv(gt.ENV, "1")
        assert not gt.enabled(), name  # (asked for, still not with collectives in the step)
        monkeypatch.delenv(gt.ENV)
        sizes[name] = 1
