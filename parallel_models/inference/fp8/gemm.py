"""The FP8 GEMM of a rollout linear: ``y = x @ W^T`` with ``W`` an FP8 weight
(:class:`~parallel_models.inference.fp8.quantize.QuantizedWeight`) and ``x`` quantized per token
(group) on the fly.

Backends (:func:`gemm_backend`):

- ``"scaled_mm"``: ``torch._scaled_mm`` on CUDA. Block weights (128 x 128) with 1 x 128
  activation tiles need Hopper (SM 9.x) and cuBLAS 12.9+ (torch's blockwise path: scale_a
  ``[tokens, in/128]`` token-major in memory, tokens padded to a multiple of 4, scale_b ``[in/128, out/128]`` with a leading
  dimension padded to 4, as torch's own tests lay them out) and in/out multiples of 128;
  channel weights (row-wise: scale_a ``[tokens, 1]``, scale_b ``[1, out]``) need SM 8.9+ and
  in/out multiples of 16. The output is bf16 (cast to the activation dtype after).
- ``"emulated"`` (the CPU, and shapes or devices the kernels do not take): the activations are
  quantized and dequantized with the same recipe, the weight dequantized, and the product taken
  in the activation dtype, so the emulation carries the FP8 rounding error the GPU path has
  (up to the accumulation order).
"""

from __future__ import annotations

import logging

import torch

from parallel_models.inference.fp8.quantize import (BLOCK, QuantizedWeight,
                                                    dequantize_activation, quantize_activation)

log = logging.getLogger(__name__)
_warned: set = set()


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _cuda_blockwise_supported(device: torch.device) -> bool:
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] == 9 and cuda >= (12, 9)


def gemm_backend(x: torch.Tensor, weight: QuantizedWeight) -> str:
    """``"scaled_mm"`` when ``torch._scaled_mm`` takes this activation and weight, else
    ``"emulated"`` (see the module docstring)."""
    if not x.is_cuda or not hasattr(torch, "_scaled_mm"):
        return "emulated"
    out, inp = weight.shape
    if weight.granularity == "block":
        ok = _cuda_blockwise_supported(x.device) and out % BLOCK == 0 and inp % BLOCK == 0
    else:
        ok = torch.cuda.get_device_capability(x.device) >= (8, 9) and out % 16 == 0 and \
            inp % 16 == 0
    if not ok:
        key = (weight.granularity, tuple(weight.shape), str(x.device))
        if key not in _warned:
            _warned.add(key)
            log.warning("fp8: no FP8 GEMM for a %s-scaled %s weight on %s: emulated "
                        "(dequantized) instead", weight.granularity, tuple(weight.shape),
                        torch.cuda.get_device_name(x.device))
    return "scaled_mm" if ok else "emulated"


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


def _scaled_mm(x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    if weight.granularity == "block":
        # torch's 1 x 128 check wants scale_a's stride to be exactly (1, tokens) and cuBLAS a
        # 16-byte aligned leading dimension: pad the rows to a multiple of 4 (zero rows, cut off)
        tokens = x2.shape[0]
        padded = _round_up(max(tokens, 1), 4)
        if padded != tokens:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, padded - tokens))
        xq, xs = quantize_activation(x2, weight.granularity)
        out = torch._scaled_mm(xq, weight.data.t(), scale_a=_token_major(xs),
                               scale_b=weight.scale.t(), out_dtype=torch.bfloat16)
        return out[:tokens]
    xq, xs = quantize_activation(x2, weight.granularity)
    return torch._scaled_mm(xq, weight.data.t(), scale_a=xs[:, None].contiguous(),
                            scale_b=weight.scale[None, :].contiguous(), out_dtype=torch.bfloat16)


def emulated_matmul(x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x2 @ W^T`` with ``x2`` quantized and dequantized per token (group), in its dtype."""
    xq, xs = quantize_activation(x2, weight.granularity)
    x_deq = dequantize_activation(xq, xs, weight.granularity, x2.dtype)
    return x_deq @ weight.dequantize(x2.dtype).t()


def fp8_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
               backend: str | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` ``[..., in]`` in the activation dtype; ``backend``: force
    ``"scaled_mm"`` or ``"emulated"`` (default: :func:`gemm_backend`)."""
    x2 = x.reshape(-1, x.shape[-1])
    backend = backend or gemm_backend(x2, weight)
    if backend == "scaled_mm":
        out = _scaled_mm(x2, weight).to(x.dtype)
    elif backend == "emulated":
        out = emulated_matmul(x2, weight)
    else:
        raise ValueError(f"fp8 GEMM backend must be scaled_mm or emulated, got {backend!r}")
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


__all__ = ["block_scale_storage", "emulated_matmul", "fp8_linear", "gemm_backend"]
