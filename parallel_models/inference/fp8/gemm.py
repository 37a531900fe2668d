"""The FP8 GEMM of a rollout linear: ``y = x @ W^T`` with ``W`` an FP8 weight
(:class:`~parallel_models.inference.fp8.quantize.QuantizedWeight`) and ``x`` quantized per token
(group) on the fly.

Backends (:func:`gemm_backend`):

- ``"scaled_mm"``: ``torch._scaled_mm`` on CUDA. Block weights (128 x 128) with 1 x 128
  activation tiles need Hopper (SM 9.x) and cuBLAS 12.9+ (torch's blockwise path: scale_a
  ``[tokens, in/128]`` token-major in memory, tokens padded to a multiple of 4, scale_b
  ``[in/128, out/128]`` with a leading dimension padded to 4, as torch's own tests lay them out)
  and in/out multiples of 128;
  channel weights (row-wise: scale_a ``[tokens, 1]``, scale_b ``[1, out]``) need SM 8.9+ and
  in/out multiples of 16. The output is bf16 (cast to the activation dtype after). The
  activations are quantized by one Triton kernel (``act_quant_kernel``: per 128-wide group for
  block weights, per token for channel ones) where triton imports and the kernels agree with the
  torch ops bit for bit, by torch ops otherwise. Once per device and granularity
  (outside a CUDA graph capture) a small product checks that ``_scaled_mm`` takes these layouts
  and agrees with the emulation; if not, a warning names the error and the emulation runs.
- decode-sized products (at most :data:`DECODE_ROWS` rows) on CUDA, whichever backend the
  larger ones take, run one of four Triton decode kernels instead (:data:`DECODE_KERNEL`;
  tiles timed per shape on the first eager call, ``decode_tuning``), where it passed its check
  on the device (with its default tiles and with a K split): ``"tma"`` (the default for
  channel-scaled weights on SM 9.0+: ``tma_decode_kernel``, W8A8 on per-token activations, the
  prefill's row-wise recipe, TMA loads; the activations come quantized by the norm or SwiGLU
  that produced them, ``fused_producers``, or by ``act_quant_kernel`` first;
  :func:`token_matmul`), ``"dynamic"``
  (``dynamic_act_kernel``: W8A8, the bf16 activations quantized inside the kernel per token and
  128-wide group, the prefill's recipe, an e4m3 x e4m3 tensor-core dot; what
  :func:`dynamic_matmul` emulates), ``"w8a8"`` (the same GEMM on activations quantized with the
  same recipe by ``act_quant_kernel`` first: one more launch, no quantization work in its K
  loop) or ``"weight_only"`` (``weight_only_kernel``: W8A16, the e4m3 weights converted to bf16
  in registers; :func:`weight_only_matmul`). Where the selected kernel fails its check the
  others are tried in turn. A decode step is memory-bound, and on an H100 the W8A8
  ``_scaled_mm`` decode (quantize kernel + cuBLAS's block-scaled GEMM at 64-256 rows) was
  slower than bf16. Prefill keeps ``_scaled_mm``'s FP8 tensor-core throughput.
- ``"emulated"`` (the CPU, and shapes or devices the kernels do not take): the activations are
  quantized and dequantized with the same recipe, the weight dequantized, and the product taken
  in the activation dtype, so the emulation carries the FP8 rounding error the GPU path has
  (up to the accumulation order).
"""

from __future__ import annotations

import logging

import torch

from parallel_models.inference.fp8.quantize import (BLOCK, QuantizedWeight, dequantize_activation,
                                                    quantize_activation, reshape_keeping_copy)

log = logging.getLogger(__name__)
_warned: set = set()
_probed: dict = {}  # (device, granularity) -> whether _scaled_mm ran and agreed with the emulation
_decode_checked: dict = {}  # (device, granularity, kernel) -> whether that decode kernel agreed
DECODE_ROWS = 64
"""Products of at most this many rows (decode steps) run a Triton decode kernel
(:data:`DECODE_KERNEL`) where it passed its check; larger ones (prefill, big decode batches) run
``_scaled_mm`` with quantized activations. 0 = every product on ``_scaled_mm``. 64: on an H100
the weight-only kernel's four 8B linears took 0.77-0.79x bf16's time at 64 rows but 1.48-1.72x
at 256 (``bench/fp8_gemm_sweep.py``, docs/PERFORMANCE.md)."""
DECODE_KERNEL = "tma"
"""The decode kernel of the products of at most :data:`DECODE_ROWS` rows: ``"tma"`` (W8A8 with
TMA loads on per-token activations, ``tma_decode_kernel``; channel scales, SM 9.0+: on an H100
the 8B decode step at batch 64 took 0.80x bf16's, against 0.84x with the weight-only kernel in
the same process, docs/PERFORMANCE.md; block-scaled weights and older GPUs take the next kernel
that passes its check), ``"weight_only"`` (W8A16, ``weight_only_kernel``: 0.82-0.85x),
``"dynamic"`` (W8A8, activations quantized in the kernel per token and 128-wide group, e4m3 x
e4m3 tensor-core dot, ``dynamic_act_kernel``) or ``"w8a8"`` (the same GEMM on activations
quantized by a kernel before it); ``bench/fp8_decode.py --decode-kernels`` times them. Read at
each call: a captured CUDA graph keeps the kernel it captured."""
_fused_quant: dict = {}  # device -> whether the Triton activation quantization is used there


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _cuda_blockwise_supported(device: torch.device) -> bool:
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] == 9 and cuda >= (12, 9)


def gemm_backend(x: torch.Tensor, weight: QuantizedWeight) -> str:
    """``"scaled_mm"`` when ``torch._scaled_mm`` takes this activation and weight, else
    ``"emulated"`` (see the module docstring)."""
    if not x.is_cuda:
        return "emulated"
    if not hasattr(torch, "_scaled_mm"):
        return "emulated"
    out, inp = weight.shape
    if weight.granularity == "block":
        ok = _cuda_blockwise_supported(x.device) and out % BLOCK == 0 and inp % BLOCK == 0
    else:
        ok = torch.cuda.get_device_capability(x.device) >= (8, 9) and out % 16 == 0 and \
            inp % 16 == 0
    if ok and not (torch.cuda.is_current_stream_capturing() or _probe(x.device,
                                                                     weight.granularity)):
        return "emulated"
    if not ok:
        key = (weight.granularity, tuple(weight.shape), str(x.device))
        if key not in _warned:
            _warned.add(key)
            log.warning("fp8: no FP8 GEMM for a %s-scaled %s weight on %s: emulated "
                        "(dequantized) instead, but for decode-sized products where a "
                        "decode kernel passed its check", weight.granularity,
                        tuple(weight.shape), torch.cuda.get_device_name(x.device))
    return "scaled_mm" if ok else "emulated"


def _probe(device: torch.device, granularity: str) -> bool:
    """Once per device and granularity: does ``_scaled_mm`` take our layouts here (this torch /
    cuBLAS) and agree with the emulation? If not, a warning names the error and the FP8 linears
    fall back to the emulation."""
    from parallel_models.inference.fp8.quantize import quantize_weight

    key = (str(device), granularity)
    _check_fused_quant(device)
    if key not in _probed:
        g = torch.Generator(device=device).manual_seed(0)
        # 512 wide: 4 blocks of 128, so the scale rows need no padding (torch 2.11 refuses a
        # padded stride, and cuBLAS misreads an unpadded one of 2 blocks; real widths are
        # multiples of 512)
        x = torch.randn(32, 512, device=device, generator=g, dtype=torch.bfloat16)
        q = quantize_weight(torch.randn(256, 512, device=device, generator=g), granularity)
        want = emulated_matmul(x.float(), q)
        for attempt in range(2):  # (the second without the Triton quantization)
            try:
                got = _scaled_mm(x, q).float()
                err = float(((got - want).abs() / (want.abs() + 1.0)).max())
                _probed[key] = err < 0.05
                problem = f"differs from the emulation by {err:.3g}"
            except RuntimeError as exc:
                _probed[key], problem = False, f"{type(exc).__name__}: {exc}"
            if _probed[key] or not _fused_quant.get(str(device)):
                break
            log.warning("fp8: _scaled_mm with the Triton-quantized activations %s; retrying "
                        "with torch ops", problem)
            _fused_quant[str(device)] = False
        if not _probed[key]:
            log.warning("fp8: torch._scaled_mm with %s scales on %s %s; the FP8 linears run "
                        "emulated (dequantized) instead", granularity,
                        torch.cuda.get_device_name(device), problem)
    return _probed[key]


def _checked_once(cache: dict, key, check, warning: str) -> bool:
    """``cache[key]``, computed once: ``check()`` -> (usable, what is wrong otherwise); an
    exception (no triton, a kernel that does not build here) counts as unusable, named by its
    type and message; an unusable answer logs ``warning`` with that problem."""
    if key not in cache:
        cache[key] = False
        try:
            cache[key], problem = check()
        except Exception as exc:  # noqa: BLE001 - no triton, or the kernel does not build here
            problem = f"{type(exc).__name__}: {exc}"
        if not cache[key]:
            log.warning(warning, problem)
    return cache[key]


def _decode_check(device: torch.device, granularity: str, kernel: str):
    """The check of one decode kernel: triton imports and the kernel agrees with its emulation
    (:func:`dynamic_matmul` / :func:`weight_only_matmul`, to bf16 rounding and accumulation
    order) with its default tiles and with row tiles and a K split (the partial sums'
    reduction; the W8A8 kernel: two activation groups a K step, the last one partial; the
    TMA kernel: a ``tokens_first`` config with a K split too; its strips of several parts are
    left to the tuner, which uses one only where it agrees with the default tiles)."""
    from parallel_models.inference.fp8.decode_tuning import (DecodeConfig, default_config,
                                                             sm_count, smem_bytes)
    from parallel_models.inference.fp8.quantize import quantize_weight

    mm, emulation = _kernel_mm(kernel), decode_emulation(kernel)
    inp, extra = 300, []
    if kernel == "weight_only":
        split_cfg = DecodeConfig(32, 16, 64, 2, num_warps=4, num_stages=3)
    elif kernel == "tma":  # (channel scales only: _kernel_preference skips it for block ones)
        if torch.cuda.get_device_capability(device) < (9, 0):
            return False, "needs the tensor memory accelerator (SM 9.0+)"
        split_cfg = DecodeConfig(64, 16, 128, 2, num_warps=4, num_stages=3)
        extra = [DecodeConfig(32, 64, 128, 2, num_warps=4, num_stages=3, tokens_first=True)]
        inp = 304  # (TMA: 16-byte rows; still a partial last K step)
    else:  # (both W8A8 kernels: the prefill's activation recipe)
        split_cfg = DecodeConfig(64, 16, 256, 2, num_warps=4, num_stages=3)
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(37, inp, device=device, generator=g, dtype=torch.bfloat16)
    storage = block_scale_storage(200, inp, device) if granularity == "block" else None
    q = quantize_weight(torch.randn(200, inp, device=device, generator=g), granularity)
    if storage is not None:  # the layout the rollout linears keep their scales in
        storage.copy_(q.scale)
        q = QuantizedWeight(q.data, storage, granularity)
    want = emulation(x, q).float()
    err = 0.0
    for cfg in (default_config(37, 200, inp, granularity, sm_count(device), smem_bytes(device),
                               kernel=kernel), split_cfg, *extra):
        got = mm(x, q, cfg).float()
        err = max(err, float(((got - want).abs() / (want.abs() + 1.0)).max()))
    return err < 2e-2, f"differs from the emulation by {err:.3g}"


def _kernel_preference(granularity: str) -> tuple[str, ...]:
    """:data:`DECODE_KERNEL`, then the other decode kernels in ``decode_tuning.KERNELS``'
    order (a kernel that fails its check gives way to the next); block-scaled weights skip the
    channel-only TMA kernel."""
    from parallel_models.inference.fp8.decode_tuning import KERNELS

    if DECODE_KERNEL not in KERNELS:
        raise ValueError(f"fp8 gemm.DECODE_KERNEL must be one of {KERNELS}, got "
                         f"{DECODE_KERNEL!r}")
    order = (DECODE_KERNEL, *(k for k in KERNELS if k != DECODE_KERNEL))
    return tuple(k for k in order if granularity == "channel" or k != "tma")


def _check_decode_kernels(device: torch.device, granularity: str) -> None:
    """Once per device, granularity and kernel: check :data:`DECODE_KERNEL` (see
    :func:`_decode_check`), and the others in turn where it fails."""
    for kernel in _kernel_preference(granularity):
        if _checked_once(_decode_checked, (str(device), granularity, kernel),
                         lambda: _decode_check(device, granularity, kernel),
                         f"fp8: the {kernel} decode kernel %s; not used"):
            return


def _decode_mm(device: torch.device, granularity: str):
    """The decode kernel's ``mm(x2, weight)`` for decode-sized products on CUDA:
    :data:`DECODE_KERNEL`'s where it passed its check (run here, outside a graph capture, the
    first time this kernel is selected on this device), else the next one's that passed
    (:func:`_kernel_preference`), else None."""
    kernel = decode_kernel(device, granularity)
    return _kernel_mm(kernel) if kernel is not None else None


def decode_kernel(device: torch.device, granularity: str) -> str | None:
    """The name of the decode kernel that decode-sized products with ``granularity`` weights
    run on ``device`` (see :func:`_decode_mm`), or None."""
    if not torch.cuda.is_current_stream_capturing():
        _check_decode_kernels(device, granularity)
    for kernel in _kernel_preference(granularity):
        if _decode_checked.get((str(device), granularity, kernel)):
            return kernel
    return None


def decode_emulation(kernel: str):
    """What ``kernel`` computes, up to the accumulation order: ``emulation(x2, weight)``."""
    return {"weight_only": weight_only_matmul, "tma": token_matmul}.get(kernel, dynamic_matmul)


def _kernel_mm(kernel: str):
    """The ``mm(x2, weight, config=None)`` of a decode kernel (imported here: triton)."""
    if kernel == "weight_only":
        from parallel_models.inference.fp8.weight_only_kernel import weight_only_mm
        return weight_only_mm
    if kernel == "tma":
        from parallel_models.inference.fp8.tma_decode_kernel import tma_mm
        return tma_mm
    from parallel_models.inference.fp8 import dynamic_act_kernel
    return (dynamic_act_kernel.dynamic_act_mm if kernel == "dynamic"
            else dynamic_act_kernel.prequantized_mm)


def weight_only_matmul(x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x2 @ dequantize(W)^T`` with ``x2`` as it is (weight-only FP8), in fp32, cast to its
    dtype: what the weight-only decode kernel computes, up to the accumulation order."""
    return (x2.float() @ weight.dequantize(torch.float32).t()).to(x2.dtype)


def block_scale_storage(out: int, inp: int, device=None) -> torch.Tensor:
    """An fp32 tensor to hold a block weight's scales, ``[ceil(out/128), ceil(in/128)]`` as a
    view with its row length padded to a multiple of 4 (the layout ``_scaled_mm`` reads)."""
    nb, kb = -(-out // BLOCK), -(-inp // BLOCK)
    return torch.ones(nb, _round_up(kb, 4), dtype=torch.float32, device=device)[:, :kb]


def _token_major(scale: torch.Tensor) -> torch.Tensor:
    """``[tokens, groups]`` activation scales stored groups-major (column-major, stride
    ``(1, tokens)``): the 1 x 128 layout ``_scaled_mm`` checks for (the token count must
    already be a multiple of 4, see :func:`_scaled_mm`)."""
    return scale.t().contiguous().t()


def _quantize_for_mm(x2: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 activations, scale_a in ``_scaled_mm``'s layout): one Triton kernel (per token and
    128-wide group for block weights, per token for channel weights) where it passed its check
    on this device (:func:`_check_fused_quant`), else torch ops."""
    if _fused_quant.get(str(x2.device)):
        from parallel_models.inference.fp8 import act_quant_kernel

        return (act_quant_kernel.quantize_token_groups(x2) if granularity == "block"
                else act_quant_kernel.quantize_tokens(x2))
    xq, xs = quantize_activation(x2, granularity)
    return xq, (_token_major(xs) if granularity == "block" else xs[:, None].contiguous())


def _check_fused_quant(device: torch.device) -> None:
    """Once per device: use the Triton activation quantization if triton imports and both
    kernels' scales and values agree with the torch version (bit for bit: one recipe; the
    group kernel's scales token-major, as ``_scaled_mm`` reads them)."""
    def check():
        from parallel_models.inference.fp8 import act_quant_kernel

        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(37, 1100, device=device, generator=g, dtype=torch.bfloat16)
        x[3, 128:256] = 0
        x[5] = 0
        agree = True
        for granularity, quantize in (("block", act_quant_kernel.quantize_token_groups),
                                      ("channel", act_quant_kernel.quantize_tokens)):
            q, s = quantize(x)
            q_ref, s_ref = quantize_activation(x, granularity)
            agree &= torch.equal(s.reshape(s_ref.shape), s_ref) and torch.equal(q.float(),
                                                                                q_ref.float())
            agree &= s.stride(0) == 1  # (block: token-major; channel: [tokens, 1])
        return bool(agree), "disagrees with the torch version"

    _checked_once(_fused_quant, str(device), check, "fp8: the Triton activation quantization "
                  "%s; torch ops instead (slower at decode)")


def _scaled_mm(x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    tokens = x2.shape[0]
    if weight.granularity == "block":
        # torch's 1 x 128 check wants scale_a's stride to be exactly (1, tokens) and cuBLAS a
        # 16-byte aligned leading dimension: pad the rows to a multiple of 4 (zero rows, cut off)
        padded = _round_up(max(tokens, 1), 4)
        if padded != tokens:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, padded - tokens))
    xq, scale_a = _quantize_for_mm(x2, weight.granularity)
    scale_b = weight.scale.t() if weight.granularity == "block" else \
        weight.scale[None, :].contiguous()
    out = torch._scaled_mm(xq, weight.data.t(), scale_a=scale_a, scale_b=scale_b,
                           out_dtype=torch.bfloat16)
    return out[:tokens]


def emulated_matmul(x2: torch.Tensor, weight: QuantizedWeight,
                    act_groups: str | None = None) -> torch.Tensor:
    """``x2 @ W^T`` with ``x2`` quantized and dequantized per token (group), in its dtype;
    ``act_groups``: the activations' granularity (``quantize_activation``'s; default: the
    weight's, as ``_scaled_mm`` pairs them)."""
    groups = act_groups or weight.granularity
    xq, xs = quantize_activation(x2, groups)
    x_deq = dequantize_activation(xq, xs, groups, x2.dtype)
    return x_deq @ weight.dequantize(x2.dtype).t()


def dynamic_matmul(x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What the W8A8-dynamic decode kernel computes, up to the accumulation order: ``x2``
    quantized per token and 128-wide group (whatever the weight's granularity: the prefill's
    recipe) times ``dequantize(W)^T``, in fp32, cast to ``x2``'s dtype."""
    return emulated_matmul(x2.float(), weight, act_groups="block").to(x2.dtype)


def token_matmul(x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What the TMA decode kernel computes, up to the accumulation order: ``x2`` quantized per
    token (``_scaled_mm``'s row-wise recipe, whatever the weight's granularity) times
    ``dequantize(W)^T``, in fp32, cast to ``x2``'s dtype."""
    return emulated_matmul(x2.float(), weight, act_groups="channel").to(x2.dtype)


def fp8_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
               backend: str | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` ``[..., in]`` in the activation dtype; ``backend``: force
    ``"scaled_mm"`` or ``"emulated"`` (default: :func:`gemm_backend`) for the products that do
    not run a decode kernel (see the module docstring)."""
    x2 = reshape_keeping_copy(x, -1, x.shape[-1])  # (its producer's copy: fused_producers)
    backend = backend or gemm_backend(x2, weight)
    decode_mm = _decode_mm(x2.device, weight.granularity) \
        if x2.is_cuda and x2.shape[0] <= DECODE_ROWS else None
    if decode_mm is not None:
        out = decode_mm(x2, weight).to(x.dtype)
    elif backend == "scaled_mm":
        out = _scaled_mm(x2, weight).to(x.dtype)
    elif backend == "emulated":
        out = emulated_matmul(x2, weight)
    else:
        raise ValueError(f"fp8 GEMM backend must be scaled_mm or emulated, got {backend!r}")
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


__all__ = ["DECODE_KERNEL", "DECODE_ROWS", "block_scale_storage", "decode_emulation",
           "decode_kernel", "dynamic_matmul",
           "emulated_matmul", "fp8_linear", "gemm_backend", "token_matmul", "weight_only_matmul"]
