"""Tile configurations of the FP8 decode GEMM kernels (``weight_only_kernel``: W8A16;
``dynamic_act_kernel``: W8A8 with the activations quantized in the kernel) and the choice of one
per decode shape and kernel, measured on the device once per process.

A :class:`DecodeConfig` says how the ``[rows, in] x [out, in]^T`` product is cut into programs:
``block_n`` output features (weight rows) by ``block_m`` activation rows per program, ``block_k``
input features per step of the K loop, ``split_k`` programs sharing one output tile's K range
(their fp32 partial sums added by the last one to finish), Triton's ``num_warps`` /
``num_stages`` (the software pipeline's depth) and, for the TMA kernel, ``tokens_first`` (the
decode rows the MMA's long side instead of the weight rows).

The choice is keyed on (row bucket, out, in, granularity, device, kernel), the row bucket being
the smallest power of two >= the rows (at least 16): the continuous engine's decode buckets are
powers of two, so a captured bucket always meets the key its eager warm-up tuned.
:func:`choose`, for a key not seen yet, times every :func:`candidates` config on the real
operands (CUDA events, the L2 cache flushed before each run, the median of a few runs; the
fastest three timed again, round-robin: :func:`tune`) and keeps the fastest; that happens in
the eager run before a CUDA graph is captured (``generation.capture_cuda_graph`` runs the step
once eagerly first), so the graph holds the chosen kernel. A config whose output disagrees
with the default config's is passed over. A kernel timed alone is not timed as the graph runs
it (dependent launch, weight prefetch, its neighbours): a few runners-up of other kinds are kept
(:data:`alternatives`) for ``graph_tuning`` to time the captured step with. A config pinned by
``PARALLEL_MODELS_FP8_DECODE_TILES`` runs instead (:func:`pinned_configs`). Inside a capture, on
the CPU (the Triton interpreter), above :data:`TUNED_ROWS` rows, or with :data:`TUNE` off, the
:func:`default_config` runs untimed. ``bench/fp8_gemm_sweep.py`` prints every candidate's time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import statistics

import torch

log = logging.getLogger(__name__)

TUNE = True
"""Time the candidates per key (False: always :func:`default_config`)."""
TUNED_ROWS = 256
"""Keys of at most this many rows are tuned (decode); larger products take the default."""
PIN_ENV = "PARALLEL_MODELS_FP8_DECODE_TILES"
"""Configs to run instead of the tuner's, per (row bucket, linear shape, kernel):
:func:`pinned_configs` (a choice that differs from process to process can be held, and
``bench/fp8_decode.py`` compares tiles in one process: ``+tiles=...``)."""
KERNELS = ("weight_only", "dynamic", "w8a8", "tma")
"""The decode GEMM kernels (``weight_only_kernel.KERNEL``, ``dynamic_act_kernel.KERNEL`` and
``KERNEL_PREQUANT``: the W8A8 GEMM quantizing its activations itself, or reading them quantized
by a kernel before it; ``tma_decode_kernel.KERNEL``: W8A8 on per-token activations, TMA loads)."""
FUSED_KERNELS = ("tma_swiglu",)
"""Decode kernels with more than the GEMM in them, tuned here but not decode GEMM choices of
``gemm`` (``swiglu_gemm_kernel.KERNEL``: gate_up with SwiGLU and its output's e4m3 copy; its
programs take 64 or 128 intermediate features, their gate and up rows:
:func:`_swiglu_candidates`)."""
W8A8_KERNELS = ("dynamic", "w8a8", "tma")  # e4m3 x e4m3 dots, K steps of whole 128-wide groups
MAX_STAGES = {"weight_only": 5, "dynamic": 8, "w8a8": 8, "tma": 8, "tma_swiglu": 8}
# (the W8A8 kernels' loops do less ALU work per weight byte, so a deeper pipeline can keep more
# loads in flight)
FP8_ACTIVATIONS = ("tma", "tma_swiglu")  # kernels whose activation tiles are e4m3 in shared memory
TOKENS_FIRST = ("tma",)  # kernels that also take ``tokens_first`` configs
TOKENS_FIRST_ROWS = (64, 128)  # ... for these row buckets (64-row tiles: the MMA's long side)
MAX_STRIP, MAX_PARTS = 240, 4  # a tokens-first strip: weight rows, power-of-two parts (16-128)
TOKENS_FIRST_TILES = ((16, 128, 8), (16, 256, 5), (32, 128, 8), (32, 256, 4))
"""(weight rows, K step, pipeline stages at most) of the ``tokens_first`` candidates: the tiles
and depths that came out fastest for the 8B o_proj / down_proj at 64 rows on an H100."""
SMEM_BYTES = 192 * 1024  # shared memory the pipeline's stages may take (an H100 SM has 227 KiB;
# a device with less: smem_bytes)
TWO_PER_SM_BYTES = 100 * 1024  # ... where two programs share an SM (the shallower variants)
MAX_WORKSPACE_BYTES = 32 << 20  # split-K partial sums of one (split, bucket, out) at most
TIMING_WARMUP, TIMING_REPS = 2, 10
REFINE_TOP, REFINE_ROUNDS = 3, 3  # the fastest few timed again, round-robin (see tune)
LAUNCH_COVER_CYCLES = 200_000  # ~100 us of GPU spin before each timed run: longer than a Triton
# launch on the host, so the events time the kernel, not the launch (CUDA graphs replay without)

GRAPH_TOP = 2  # runners-up kept per key: the fastest this many, and of each other _family

_chosen: dict = {}  # key -> DecodeConfig
alternatives: dict = {}  # key -> [DecodeConfig]: the runners-up that agree (see _agreeing)
fresh: list = []  # keys tuned that graph_tuning has not compared in a graph yet
used: set = set()  # keys asked for since graph_tuning last cleared it (the step it captures)
_timing = False  # inside tune(): the candidates launch without dependent launch
timings: dict = {}  # key -> [(DecodeConfig, ms)] of the candidates timed for it
_warned: set = set()


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One way to run the decode GEMM (see the module docstring)."""

    block_n: int
    block_m: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    tokens_first: bool = False
    """The MMA's long side the decode rows, the weight rows its short one (:data:`TOKENS_FIRST`
    kernels): strips of 16 or 32 weight rows, or of any multiple of 16 up to
    :data:`MAX_STRIP` in power-of-two parts (:func:`strip_parts`)."""

    def grid(self, rows: int, out: int) -> int:
        """Programs of a ``rows`` x ``out`` product (one dimension)."""
        return _cdiv(rows, self.block_m) * self.split_k * _cdiv(out, self.block_n)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_bucket(rows: int) -> int:
    """The smallest power of two >= ``rows``, at least 16 (tl.dot's smallest tile side)."""
    return max(16, 1 << max(rows - 1, 0).bit_length())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the CPU: an H100's 132, so the choice the tests
    see is the one an H100 starts from)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def smem_bytes(device: torch.device) -> int:
    """Shared memory the pipeline may take on ``device``: :data:`SMEM_BYTES`, less on an SM
    with less (100 KiB on SM 8.9), keeping 1 KiB the driver reserves per program and 8 KiB for
    Triton's own use."""
    if device.type != "cuda":
        return SMEM_BYTES
    props = torch.cuda.get_device_properties(device)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or SMEM_BYTES + 9216
    return min(SMEM_BYTES, per_sm - 9216)


def _split_for(tiles: int, k_tiles: int, sms: int) -> int:
    """The smallest power-of-two K split that gives at least two programs per SM, keeping >= 4
    K steps per program."""
    split = 1
    while tiles * split < 2 * sms and k_tiles >= 8 * split:
        split *= 2
    return split


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS + FUSED_KERNELS:
        raise ValueError(f"fp8 decode GEMM kernel must be one of {KERNELS + FUSED_KERNELS}, "
                         f"got {kernel!r}")


def stage_bytes(block_n: int, block_m: int, block_k: int, kernel: str = "weight_only") -> int:
    """Shared memory of one pipeline stage: the e4m3 weight tile (``tma_swiglu``: two, gate and
    up) and the activations (16-bit; e4m3 for :data:`FP8_ACTIVATIONS`)."""
    weight_rows = 2 * block_n if kernel in FUSED_KERNELS else block_n
    return weight_rows * block_k + (1 if kernel in FP8_ACTIVATIONS else 2) * block_m * block_k


def _swiglu_candidates(rows: int, smem: int) -> list[DecodeConfig]:
    """``tma_swiglu``'s configs: 64 or 128 features (one e4m3 scale group) by up to 64 rows a
    program, K steps of 128 and 256, 4 or 8 warps, either operand the MMA's long side (tokens
    first with 64-row tiles only), the deepest pipeline that fits; no K split. The first is
    the untimed default."""
    block_m = min(row_bucket(rows), 64)
    configs = []
    for block_n in (64, 128):
        for block_k in (128, 256):
            stages = max(2, min(MAX_STAGES["tma_swiglu"],
                                smem // stage_bytes(block_n, block_m, block_k, "tma_swiglu")))
            for tokens_first in (False, True) if block_m == 64 else (False,):
                for num_warps in (4, 8) if block_n == 64 else (8, 4):
                    configs.append(DecodeConfig(block_n, block_m, block_k, 1, num_warps,
                                                stages, tokens_first))
    return configs


def _config(rows: int, out: int, inp: int, block_n: int, block_m: int, block_k: int,
            split_k: int | None, sms: int, smem: int, kernel: str = "weight_only"
            ) -> DecodeConfig:
    tiles = _cdiv(row_bucket(rows), block_m) * _cdiv(out, block_n)
    if split_k is None:
        split_k = _split_for(tiles, _cdiv(inp, block_k), sms)
    stage = stage_bytes(block_n, block_m, block_k, kernel)
    return DecodeConfig(block_n, block_m, block_k, split_k,
                        num_warps=4 if block_n * block_m <= 64 * 64 else 8,
                        num_stages=max(2, min(MAX_STAGES[kernel], smem // stage)))


def _workspace_ok(cfg: DecodeConfig, rows: int, out: int) -> bool:
    return cfg.split_k == 1 or cfg.split_k * row_bucket(rows) * out * 4 <= MAX_WORKSPACE_BYTES


def default_config(rows: int, out: int, inp: int, granularity: str, sms: int = 132,
                   smem: int = SMEM_BYTES, kernel: str = "weight_only") -> DecodeConfig:
    """The untimed choice: 64 output features (128 from 64 rows on: the activation tile's L2
    reads per weight byte halve) by all the rows (128-row tiles above 128), 128-wide K steps, K
    split until the SMs have two programs each (either kernel)."""
    _check_kernel(kernel)
    if kernel in FUSED_KERNELS:
        return _swiglu_candidates(rows, smem)[0]
    bucket = row_bucket(rows)
    block_m, block_n = min(bucket, 128), 64 if bucket <= 32 else 128
    cfg = _config(rows, out, inp, block_n, block_m, 128, None, sms, smem, kernel)
    while not _workspace_ok(cfg, rows, out):
        cfg = dataclasses.replace(cfg, split_k=cfg.split_k // 2)
    return cfg


def _block_ks(kernel: str, granularity: str, block_n: int, block_m: int) -> list[int]:
    """K steps tried for a tile, the first also at half its K split and shallower. The weight-only
    kernel: 128 (64 with 256 rows; 256 too for channel scales with small tiles: a block-scaled
    step must lie inside one scale block). The W8A8 kernel's steps are whole 128-wide
    activation groups: 128, and 256 (the same bytes a step as 128 bf16 weights) where the
    accumulators are at most 64 x 128 values."""
    if kernel in W8A8_KERNELS:
        return [128, 256] if block_n * block_m <= 128 * 64 else [128]
    block_ks = [128 if block_m <= 128 else 64]
    if granularity == "channel" and block_m <= 64 and block_n <= 64:
        block_ks.append(256)
    return block_ks


def candidates(rows: int, out: int, inp: int, granularity: str, sms: int = 132,
               smem: int = SMEM_BYTES, kernel: str = "weight_only") -> list[DecodeConfig]:
    """The configs timed for a key: 32 / 64 / 128 output features (from 64 rows: 64 / 128 /
    256) by all the bucket's rows or (128 rows and more) half of them (accumulators of at most
    128 x 128 values; the W8A8 kernel's row tiles at most 128); the kernel's K steps
    (:func:`_block_ks`), each at every power-of-two K split up to the one that fills the SMs
    (and for 4-warp programs with a pipeline shallow enough for two programs per SM). The
    smaller splits are there because filling the SMs is not always fastest: each split adds
    its fp32 partial sums' traffic and the last program's serial hand-over; at 64 rows on an
    H100 the 8B qkv / o / down GEMMs ran 15.0 / 14.2 / 29.4 us with 1 / 1 / 2 splits against
    22.5 / 16.8 / 35.4 us at the SM-filling ones (docs/PERFORMANCE.md, session 19)."""
    _check_kernel(kernel)
    if kernel in FUSED_KERNELS:
        return _swiglu_candidates(rows, smem)
    bucket = min(row_bucket(rows), TUNED_ROWS)
    out_list = []
    for block_m in sorted({bucket, bucket // 2 if bucket >= 128 else bucket}):
        if kernel in W8A8_KERNELS and block_m > 128:  # (the x tile's registers would spill)
            continue
        for block_n in (32, 64, 128) if bucket <= 32 else (64, 128, 256):
            if block_n * block_m > 128 * 128:
                continue
            block_ks = _block_ks(kernel, granularity, block_n, block_m)
            for block_k in block_ks:
                full = _config(rows, out, inp, block_n, block_m, block_k, None, sms, smem,
                               kernel)
                variants = [dataclasses.replace(full, split_k=1 << s)
                            for s in range(full.split_k.bit_length())]
                stage = stage_bytes(block_n, block_m, block_k, kernel)
                if kernel in FP8_ACTIVATIONS and full.num_warps == 8 and \
                        block_n * block_m <= 128 * 64 and block_k == block_ks[0]:
                    # (one warpgroup holds the 128 x 64 accumulators)
                    variants.append(dataclasses.replace(full, num_warps=4))
                two_per_sm = min(full.num_stages, min(TWO_PER_SM_BYTES, smem // 2) // stage)
                if block_k == block_ks[0] and full.num_warps == 4 and \
                        3 <= two_per_sm < full.num_stages:
                    variants.append(dataclasses.replace(full, num_stages=two_per_sm))
                out_list += [cfg for cfg in variants
                             if _workspace_ok(cfg, rows, out) and cfg not in out_list]
    if kernel in TOKENS_FIRST and bucket in TOKENS_FIRST_ROWS:
        out_list += [cfg for cfg in _tokens_first(rows, out, inp, granularity, sms, smem,
                                                  kernel)
                     if _workspace_ok(cfg, rows, out) and cfg not in out_list]
    return out_list


def strip_parts(width: int) -> tuple[int, ...]:
    """The power-of-two parts (largest first) of a tokens-first strip ``width`` weight rows
    wide: its binary digits from 16 up (one part where ``width`` is a power of two; at most
    :data:`MAX_PARTS`, as ``width`` <= :data:`MAX_STRIP`)."""
    if width % 16 or not 16 <= width <= MAX_STRIP:
        raise ValueError(f"fp8 decode GEMM: a tokens-first strip of {width} rows; it takes "
                         f"multiples of 16 up to {MAX_STRIP}")
    return tuple(1 << b for b in range(width.bit_length() - 1, 3, -1) if width >> b & 1)


def _tokens_first(rows: int, out: int, inp: int, granularity: str, sms: int, smem: int,
                  kernel: str) -> list[DecodeConfig]:
    """The ``tokens_first`` candidates: 64-row tiles by :data:`TOKENS_FIRST_TILES`, each at every
    power-of-two K split up to the one that fills the SMs, but none where the strips before the
    split already give every SM a program (the splits' partial sums and hand-over cost more in
    the decode graph than timed alone: the 8B o_proj's 16-row strips in 2 splits, which the
    tuner once chose, took 18.1 us a layer in the graph against 9.7 us for unsplit 32-row
    strips; ``bench/decode_timeline.py``, docs/PERFORMANCE.md session 21); and (no K split)
    strips of one SM's share of the output features rounded up to 16, where that is no power
    of two (several parts, one activation tile: the 8B gate_up's 224 rows make 128 programs,
    one wave; channel scales only, as the TMA kernel takes)."""
    configs = []
    strip = -(-_cdiv(out, sms) // 16) * 16
    if granularity == "channel" and strip & (strip - 1) and 48 <= strip <= MAX_STRIP:
        warps = 8 if strip > 128 else 4  # (4 warps would spill a 224-row strip's sums)
        for block_k, num_warps in sorted({(128, warps), (128, 8), (256, warps)}):
            if _cdiv(inp, block_k) >= 4:
                configs.append(dataclasses.replace(
                    _config(rows, out, inp, strip, 64, block_k, 1, sms, smem, kernel),
                    num_warps=num_warps, tokens_first=True))
    for block_n, block_k, stages in TOKENS_FIRST_TILES:
        if _cdiv(inp, block_k) < 4:
            continue
        full = _config(rows, out, inp, block_n, 64, block_k, None, sms, smem, kernel)
        full = dataclasses.replace(full, tokens_first=True,
                                   num_stages=min(stages, full.num_stages))
        configs += [dataclasses.replace(full, split_k=1 << s)
                    for s in range(full.split_k.bit_length())
                    if s == 0 or _cdiv(out, block_n) << (s - 1) < sms]
    return configs


def time_ms(fn, warmup: int = TIMING_WARMUP, reps: int = TIMING_REPS,
            flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (CUDA events), ``flush``
    (a buffer larger than the L2 cache) read before each timed run so the weights are read from
    HBM as in a decode step (read, not written: evicting dirty lines during ``fn`` would bill it
    for the flush's write-back, ~7-10 us a GEMM on an H100), and the GPU kept busy while ``fn``
    is launched (a decode step replays its kernels from a CUDA graph: their launch cost is not
    theirs)."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        if flush is not None:
            flush.max()  # (a read of every line: clean evictions)
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)  # the GPU busy while the host enqueues fn
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A byte buffer twice the device's L2 cache (for :func:`time_ms`)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return torch.empty(2 * max(l2, 1 << 20), dtype=torch.uint8, device=device)


def tune(configs: list[DecodeConfig], run, device: torch.device) -> list[tuple]:
    """``[(config, ms)]`` of ``run(config)`` for each config that builds (a config that does not
    build here, e.g. out of shared memory, is left out), fastest first. The :data:`REFINE_TOP`
    fastest are timed again in :data:`REFINE_ROUNDS` round-robin rounds and ranked by the median
    of their rounds: the candidates are often within 0.5 us of each other, about the noise of
    one median of 10 runs, and a drift of the clock during the first pass would favour whichever
    ran then (an 8B o_proj once got a 2 us slower tile so). The kernels run without
    programmatic dependent launch here (:func:`timing`): launched early against the spin and
    the events around them, they were timed erratically, and the choices of one process
    differed from the next (the 8B o_proj: 16-row strips, 64 x 128 or 256 x 64 tiles with 2
    splits; the step 0.67x to 0.72x bf16, session 20)."""
    global _timing
    try:
        flush = l2_flush_buffer(device)
    except torch.OutOfMemoryError:  # (a tight memory plan: time with the L2 warm instead)
        flush = None
    results, _timing = [], True
    try:
        for cfg in configs:
            try:
                results.append((cfg, time_ms(lambda: run(cfg), flush=flush)))
            except Exception as exc:  # noqa: BLE001 - Triton's OutOfResources, a PTX error, ...
                log.debug("fp8 decode GEMM: %s does not run here: %s", cfg, exc)
        results.sort(key=lambda r: r[1])
        top = [cfg for cfg, _ in results[:REFINE_TOP]]
        rounds = {cfg: [ms] for cfg, ms in results[:REFINE_TOP]}
        for _ in range(REFINE_ROUNDS if len(top) > 1 else 0):
            for cfg in top:
                rounds[cfg].append(time_ms(lambda: run(cfg), warmup=1, flush=flush))
    finally:
        _timing = False
    del flush
    refined = sorted(((cfg, statistics.median(rounds[cfg])) for cfg in top), key=lambda r: r[1])
    return refined + results[len(top):]


def timing() -> bool:
    """Whether :func:`tune` is timing candidates now (``dependent_launch`` stays off then)."""
    return _timing


def _family(cfg: DecodeConfig) -> tuple:  # what its time in the graph depends on beyond its
    return cfg.tokens_first, cfg.split_k > 1  # time alone (PERFORMANCE.md, session 21)


def _agreeing(results: list[tuple], default: DecodeConfig, run) -> list[DecodeConfig]:
    """Timed configs whose outputs agree with the default's (to bf16 rounding and accumulation
    order), fastest first: the :data:`GRAPH_TOP` fastest, then the fastest of each other
    :func:`_family` (``graph_tuning`` compares them in the step's graph)."""
    try:
        want = run(default).to(torch.float32, copy=True)  # (run rewrites one output each time)
    except Exception as exc:  # noqa: BLE001 - the default does not build on this device
        if not results:
            raise
        log.warning("fp8 decode GEMM: the default tiles %s do not run here (%s); the fastest "
                    "candidate %s unchecked", default, exc, results[0][0])
        return [results[0][0]]
    tol = 2.0 ** -7 * (float(want.abs().max()) + 1.0)
    out, families = [], set()
    for cfg, _ in results:
        if len(out) >= GRAPH_TOP and _family(cfg) in families:
            continue
        if cfg == default or float((run(cfg).float() - want).abs().max()) <= tol:
            out.append(cfg)
            families.add(_family(cfg))
        else:
            log.warning("fp8 decode GEMM: %s disagrees with the default tiles %s; not used",
                        cfg, default)
    return out or [default]


def key_of(rows: int, out: int, inp: int, granularity: str, device: torch.device,
           kernel: str = "weight_only") -> tuple:
    return (row_bucket(rows), out, inp, granularity, str(device), kernel)


def pinned_configs(text: str | None = None) -> dict:
    """The configs :data:`PIN_ENV` (or ``text``) pins: ``(row bucket, out, in, kernel) ->
    DecodeConfig``, from entries ``BUCKET:OUTxIN[:KERNEL]=block_n,block_m,block_k,split_k,
    num_warps,num_stages[,tf]`` separated by ``/`` (kernel default ``tma``; ``tf``: tokens
    first), e.g. ``64:4096x4096=32,64,256,1,4,4,tf``. A malformed entry raises ValueError
    naming the variable and the entry."""
    return dict(_parse_pins(os.environ.get(PIN_ENV, "") if text is None else text))


@functools.lru_cache(maxsize=8)
def _parse_pins(text: str) -> dict:
    """:func:`pinned_configs` of ``text``, parsed once (``choose`` asks on every product)."""
    pins = {}
    for entry in filter(None, (e.strip() for e in text.split("/"))):
        try:
            where, tiles = entry.split("=")
            bucket, shape, *kernel = where.split(":")
            out, inp = (int(v) for v in shape.split("x"))
            values = tiles.split(",")
            tokens_first = values[6:] == ["tf"]
            if len(values) != 6 + tokens_first or len(kernel) > 1:
                raise ValueError
            cfg = DecodeConfig(*(int(v) for v in values[:6]), tokens_first=tokens_first)
            kernel = kernel[0] if kernel else "tma"
            _check_kernel(kernel)
            if row_bucket(int(bucket)) != int(bucket):
                raise ValueError
        except ValueError:
            raise ValueError(f"{PIN_ENV}: {entry!r} is no BUCKET:OUTxIN[:KERNEL]=block_n,"
                             "block_m,block_k,split_k,num_warps,num_stages[,tf] (bucket a "
                             "row bucket: 16, 32, 64, ...)") from None
        pins[(int(bucket), out, inp, kernel)] = cfg
    return pins


def choose(rows: int, out: int, inp: int, granularity: str, device: torch.device,
           run, kernel: str = "weight_only") -> DecodeConfig:
    """The config of ``kernel`` for this product (see the module docstring), or the one
    :data:`PIN_ENV` pins for it (:func:`pinned_configs`); ``run(config)`` launches the kernel
    on the real operands and returns its output (overwritten by each run)."""
    key = key_of(rows, out, inp, granularity, device, kernel)
    used.add(key)
    pinned = _parse_pins(os.environ.get(PIN_ENV, "")).get((key[0], out, inp, kernel))
    if pinned is not None:
        return pinned
    cfg = _chosen.get(key)
    if cfg is not None:
        return cfg
    limits = (sm_count(device), smem_bytes(device))
    default = default_config(rows, out, inp, granularity, *limits, kernel=kernel)
    if device.type != "cuda" or not TUNE or rows > TUNED_ROWS:
        return default
    if torch.cuda.is_current_stream_capturing():
        if key not in _warned:
            _warned.add(key)
            log.warning("fp8 decode GEMM: %s first met inside a CUDA graph capture: its default "
                        "tiles %s, untuned", key, default)
        return default
    results = tune(candidates(rows, out, inp, granularity, *limits, kernel=kernel), run, device)
    timings[key] = results
    _chosen[key], *alternatives[key] = _agreeing(results, default, run)
    fresh.append(key)
    log.info("fp8 decode GEMM %s: %s (%.1f us of %d candidates)", key, _chosen[key],
             1e3 * results[0][1] if results else float("nan"), len(results))
    return _chosen[key]


def chosen_configs() -> dict:
    """key -> the config :func:`choose` settled on (a copy)."""
    return dict(_chosen)


def settle(key: tuple, cfg: DecodeConfig) -> None:
    _chosen[key] = cfg  # the choice for ``key`` from now on (``graph_tuning``'s verdict)


__all__ = ["DecodeConfig", "FP8_ACTIVATIONS", "FUSED_KERNELS", "GRAPH_TOP", "KERNELS",
           "MAX_PARTS", "MAX_STAGES", "MAX_STRIP", "PIN_ENV", "REFINE_ROUNDS", "REFINE_TOP",
           "TOKENS_FIRST", "TOKENS_FIRST_ROWS", "TOKENS_FIRST_TILES", "TUNE", "TUNED_ROWS",
           "W8A8_KERNELS", "alternatives", "candidates", "choose", "chosen_configs",
           "default_config", "fresh", "key_of", "l2_flush_buffer", "pinned_configs",
           "row_bucket", "settle", "sm_count", "smem_bytes", "stage_bytes", "strip_parts",
           "time_ms", "timing", "timings", "tune", "used"]
