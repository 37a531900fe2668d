"""The FP8 decode GEMMs' tile choice (``inference/fp8/decode_tuning.py``), on the CPU without
triton: the row buckets match the continuous engine's decode buckets; every candidate config of
either kernel for the 8B and 0.89B linears at decode row counts keeps within the kernel's limits
(weight-only with block scales: no K step crosses a 128 x 128 scale block; W8A8-dynamic: K steps
of whole 128-wide activation groups, row tiles of at most 128; a tile spans block rows only
whole; the pipeline's stages fit the shared memory; accumulators and split-K workspaces bounded)
and some candidate fills an H100's 132 SMs, each tile at every power-of-two K split up to
the one that does; the default is a candidate; and ``choose`` times a
key (per kernel) once, keeps the fastest whose output agrees with the default's, runs the
default untimed inside a graph capture (without caching it) and on the CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # (triton comes in with parallel_models.inference where it is
    os.environ["TRITON_INTERPRET"] = "1"  # installed: the interpreter tests after this need it)

from parallel_models.inference.bucket_step import bucket_sizes  # noqa: E402
from parallel_models.inference.fp8 import decode_tuning as dt  # noqa: E402

LINEARS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),  # 8B: qkv, o, gate_up, down
           (4096, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]   # 0.89B


def test_row_buckets_cover_the_engine_buckets():
    assert [dt.row_bucket(r) for r in (1, 2, 16, 17, 64, 65, 200, 256)] == \
        [16, 16, 16, 32, 64, 128, 256, 256]
    for size in bucket_sizes(256):  # a captured bucket meets the key its warm-up tuned
        assert dt.row_bucket(size) == max(16, size)


@pytest.mark.parametrize("kernel", dt.KERNELS)
@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("rows", [1, 16, 64, 128, 256])
def test_candidates_keep_the_kernel_limits_and_fill_the_sms(granularity, rows, kernel):
    for out, inp in LINEARS:
        cands = dt.candidates(rows, out, inp, granularity, 132, kernel=kernel)
        assert cands and len(cands) == len(set(cands)) and len(cands) <= 48

        def tile(c):
            return c.block_n, c.block_m, c.block_k, c.tokens_first
        for t in {tile(c) for c in cands}:  # each tile at every power-of-two split to its largest
            splits = {c.split_k for c in cands if tile(c) == t}
            assert splits == {1 << s for s in range(max(splits).bit_length())}, (t, splits)
        first = [c for c in cands if c.tokens_first]  # (the MMA's long side: 64 decode rows)
        assert all(c.block_m == 64 for c in first)
        for c in first:  # 16 / 32-row strips, or one SM's share in parts without a K split
            assert c.block_n in (16, 32) or c.split_k == 1 and len(dt.strip_parts(c.block_n)) > 1
        assert bool(first) == (kernel in dt.TOKENS_FIRST and dt.row_bucket(rows) in (64, 128))
        for c in cands:
            if kernel in dt.W8A8_KERNELS:
                assert c.block_k % 128 == 0 and c.block_m <= 128, c
            elif granularity == "block":
                assert 128 % c.block_k == 0
            if granularity == "block":
                assert 128 % c.block_n == 0 or c.block_n % 128 == 0
            assert c.num_stages <= dt.MAX_STAGES[kernel]
            act_bytes = 1 if kernel in dt.FP8_ACTIVATIONS else 2  # (the TMA kernel: e4m3)
            assert c.num_stages * (c.block_n * c.block_k + act_bytes * c.block_m * c.block_k) \
                <= dt.SMEM_BYTES or c.num_stages == 2, c
            assert c.block_n * c.block_m <= 128 * 128 and c.block_m <= dt.row_bucket(rows)
            assert c.split_k == 1 or c.split_k * dt.row_bucket(rows) * out * 4 <= \
                dt.MAX_WORKSPACE_BYTES
            assert -(-inp // c.block_k) >= 4 * c.split_k or c.split_k == 1, c  # >= 4 K steps
        # (within 5% of the SM count: 0.89B's o_proj at 64 rows gets 128 programs of 4 K steps)
        assert max(c.grid(rows, out) for c in cands) >= 0.95 * 132, (out, inp)
        assert dt.default_config(rows, out, inp, granularity, 132, kernel=kernel) in cands


def test_a_device_with_less_shared_memory_gets_shallower_pipelines():
    smem = 100 * 1024 - 9216  # an SM 8.9 SM's, less the driver's and Triton's reserves
    for rows in (16, 64, 256):
        for c in dt.candidates(rows, 4096, 14336, "block", 132, smem):
            stage = c.block_n * c.block_k + 2 * c.block_m * c.block_k
            assert c.num_stages * stage <= smem or c.num_stages == 2, c
        small = dt.default_config(rows, 4096, 14336, "block", 132, smem).num_stages
        big = dt.default_config(rows, 4096, 14336, "block", 132).num_stages
        assert small < big if rows >= 64 else small == big  # (16-row tiles fit either way)
        for c in dt.candidates(rows, 4096, 14336, "block", 132, smem, kernel="dynamic"):
            assert c.num_stages * dt.stage_bytes(c.block_n, c.block_m, c.block_k) <= smem \
                or c.num_stages == 2, c
        small = dt.default_config(rows, 4096, 14336, "block", 132, smem, kernel="dynamic")
        big = dt.default_config(rows, 4096, 14336, "block", 132, kernel="dynamic")
        assert small.num_stages < big.num_stages  # (8 deep where the SM has room)


def test_choose_times_once_keeps_the_fastest_agreeing_and_never_tunes_in_a_capture(
        monkeypatch):
    capturing = [False]
    timed = []
    cuda = torch.device("cuda", 0)
    cands = dt.candidates(64, 4096, 4096, "block", 132)
    default = dt.default_config(64, 4096, 4096, "block", 132)
    wrong = cands[-1]  # the "fastest" computes something else: passed over

    def fake_tune(configs, run, device):  # the later a candidate, the "faster"
        timed.append(len(configs))
        return sorted(((c, 1.0 + i) for i, c in enumerate(reversed(configs))),
                      key=lambda r: r[1])

    def run(cfg):
        return torch.full((4, 8), 2.0 if cfg == wrong else 1.0)

    monkeypatch.setattr(dt, "tune", fake_tune)
    monkeypatch.setattr(dt, "sm_count", lambda device: 132)
    monkeypatch.setattr(dt, "smem_bytes", lambda device: dt.SMEM_BYTES)
    monkeypatch.setattr(dt, "_chosen", {})
    monkeypatch.setattr(dt, "timings", {})
    monkeypatch.setattr(dt, "alternatives", {})
    monkeypatch.setattr(dt, "fresh", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    capturing[0] = True  # first met inside a capture: the default, untimed, not remembered
    assert dt.choose(64, 4096, 4096, "block", cuda, run) == default and not timed
    capturing[0] = False
    assert dt.choose(50, 4096, 4096, "block", cuda, run) == cands[-2]  # bucket 64
    assert dt.choose(64, 4096, 4096, "block", cuda, run) == cands[-2] and timed == [len(cands)]
    key = dt.key_of(64, 4096, 4096, "block", cuda)
    assert dt.fresh == [key] and wrong not in dt.alternatives[key]  # (graph_tuning's runners-up)
    capturing[0] = True  # tuned before: the capture gets the tuned config
    assert dt.choose(33, 4096, 4096, "block", cuda, run) == cands[-2] and len(timed) == 1
    capturing[0] = False
    assert dt.choose(64, 4096, 4096, "channel", cuda, run) != default and len(timed) == 2
    dyn = dt.candidates(64, 4096, 4096, "block", 132, kernel="dynamic")  # its own key
    wrong = dyn[-1]
    assert dt.choose(64, 4096, 4096, "block", cuda, run, kernel="dynamic") == dyn[-2]
    assert len(timed) == 3 and timed[-1] == len(dyn)
    assert dt.choose(64, 4096, 4096, "block", cuda, run) == cands[-2]  # (still weight-only's)
    assert dt.choose(300, 4096, 4096, "block", cuda, run) == \
        dt.default_config(300, 4096, 4096, "block", 132) and len(timed) == 3  # prefill-sized
    assert dt.choose(64, 4096, 4096, "block", torch.device("cpu"), run) == default
    assert len(timed) == 3
    with pytest.raises(ValueError, match="weight_only"):
        dt.choose(64, 4096, 4096, "block", cuda, run, kernel="w4a16")


def test_tune_times_the_fastest_again_round_robin(monkeypatch):
    a, b, c, d = dt.candidates(64, 4096, 4096, "channel", 132, kernel="tma")[:4]
    first = {a: 1.0, b: 1.1, c: 1.2, d: 2.0}  # a was lucky in the first pass
    again = {a: 1.3, b: 1.1, c: 1.2}
    calls = []

    def fake_time_ms(fn, warmup=dt.TIMING_WARMUP, reps=dt.TIMING_REPS, flush=None):
        cfg = fn()
        calls.append(cfg)
        return (first if calls.count(cfg) == 1 else again)[cfg]

    monkeypatch.setattr(dt, "time_ms", fake_time_ms)
    monkeypatch.setattr(dt, "l2_flush_buffer", lambda device: None)
    results = dt.tune([a, b, c, d], lambda cfg: cfg, torch.device("cuda", 0))
    assert [cfg for cfg, _ in results] == [b, c, a, d]  # ranked by the median of the rounds
    assert calls == [a, b, c, d] + [a, b, c] * dt.REFINE_ROUNDS  # the top 3, round-robin
    assert dict(results)[d] == 2.0
    calls.clear()
    assert [cfg for cfg, _ in dt.tune([d], lambda cfg: cfg, torch.device("cuda", 0))] == [d]
    assert calls == [d]  # one candidate: nothing to compare


def test_candidates_are_timed_without_dependent_launch(monkeypatch):
    """``timing()`` is True while tune() runs the candidates (dependent_launch stays off), and
    False after it, also after candidates that raised and after an interrupted tune()."""
    seen = []

    def run(cfg):
        seen.append(dt.timing())
        if cfg.split_k > 1:
            raise RuntimeError("does not build")
        return cfg

    monkeypatch.setattr(dt, "time_ms", lambda fn, **kw: fn() and 1.0)
    monkeypatch.setattr(dt, "l2_flush_buffer", lambda device: None)
    configs = dt.candidates(64, 4096, 4096, "channel", 132, kernel="tma")[:4]
    assert not dt.timing()
    dt.tune(configs, run, torch.device("cuda", 0))
    assert seen and all(seen) and not dt.timing()

    def interrupted(fn, **kw):
        raise KeyboardInterrupt  # (not a candidate's failure: leaves tune)

    monkeypatch.setattr(dt, "time_ms", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dt.tune(configs, run, torch.device("cuda", 0))
    assert not dt.timing()


def test_an_sm_share_strip_in_power_of_two_parts():
    strips = {c.block_n for c in dt.candidates(64, 28672, 4096, "channel", 132, kernel="tma")
              if c.tokens_first}
    assert 224 in strips and -(-28672 // 224) == 128  # 8B gate_up: one wave of 128 programs
    assert dt.strip_parts(224) == (128, 64, 32) and dt.strip_parts(48) == (32, 16)
    assert not any(c.block_n == 32 and c.split_k == 1 and c.num_warps == 8  # (4096 / 132 -> 32:
                   for c in dt.candidates(64, 4096, 4096, "channel", 132, kernel="tma"))  # a tile)
    for bad in (8, 40, 256):
        with pytest.raises(ValueError, match="strip of"):
            dt.strip_parts(bad)


def test_tokens_first_strips_split_only_short_of_a_program_per_sm():
    """A tokens-first tile is split along K only while its strips leave SMs without a program:
    the 8B o_proj's 16-row strips (256 programs on 132 SMs) never, its 32-row ones (128) in
    two; the qkv's 32-row strips (192) never."""
    def splits(out, inp, block_n):
        return sorted({c.split_k for c in dt.candidates(64, out, inp, "channel", sms=132,
                                                         kernel="tma")
                       if c.tokens_first and c.block_n == block_n})

    assert splits(4096, 4096, 16) == [1]
    assert splits(4096, 4096, 32) == [1, 2]
    assert splits(6144, 4096, 32) == [1]
    assert splits(4096, 14336, 32) == [1, 2]


def test_pinned_tiles_run_instead_of_the_tuners(monkeypatch):
    """``PARALLEL_MODELS_FP8_DECODE_TILES`` pins a config per (row bucket, linear shape,
    kernel): ``choose`` returns it without timing anything; a malformed entry names the
    variable and the entry."""
    pins = dt.pinned_configs("64:4096x4096=32,64,256,1,4,4,tf / "
                             "64:28672x4096:tma_swiglu=128,64,128,1,4,4,tf/16:6144x4096=64,16,"
                             "128,2,4,3")
    assert pins == {
        (64, 4096, 4096, "tma"): dt.DecodeConfig(32, 64, 256, 1, 4, 4, tokens_first=True),
        (64, 28672, 4096, "tma_swiglu"): dt.DecodeConfig(128, 64, 128, 1, 4, 4,
                                                         tokens_first=True),
        (16, 6144, 4096, "tma"): dt.DecodeConfig(64, 16, 128, 2, 4, 3)}
    for bad in ("64:4096x4096=32,64,256", "48:4096x4096=32,64,256,1,4,4",
                "64:4096=32,64,256,1,4,4", "64:4096x4096:nope=32,64,256,1,4,4",
                "64:4096x4096=32,64,256,1,4,4,xx"):
        with pytest.raises(ValueError, match="PARALLEL_MODELS_FP8_DECODE_TILES"):
            dt.pinned_configs(bad)
    monkeypatch.setenv(dt.PIN_ENV, "64:4096x4096=32,64,256,1,4,4,tf")

    def never(cfg):
        raise AssertionError("a pinned key is not timed")

    got = dt.choose(50, 4096, 4096, "channel", torch.device("cpu"), never, kernel="tma")
    assert got == dt.DecodeConfig(32, 64, 256, 1, 4, 4, tokens_first=True)
    other = dt.choose(50, 4096, 4096, "channel", torch.device("cpu"), never,
                      kernel="weight_only")  # (another kernel: its own default)
    assert other == dt.default_config(50, 4096, 4096, "channel", dt.sm_count(
        torch.device("cpu")), dt.smem_bytes(torch.device("cpu")), kernel="weight_only")
