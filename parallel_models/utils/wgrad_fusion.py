"""Weight-gradient GEMMs that accumulate straight into megatron's fp32 ``main_grad`` (opt-in).

Without it a linear's backward writes its weight gradient as a new bf16 tensor and megatron's DDP
hook then adds it into the fp32 gradient buffer (``main_grad.add_(grad)``). megatron-core fuses
the two (``gradient_accumulation_fusion``) through APEX's ``fused_weight_gradient_mlp_cuda``
extension, which these hosts lack; this module supplies the same two functions from torch
itself: cuBLAS ``addmm`` with ``out_dtype=float32`` writing into ``main_grad`` (beta = 1, bf16
inputs, fp32 accumulation and output). The gradient then skips one bf16 rounding per
microbatch.

It is off unless the option ``wgrad_fusion`` is on (``PARALLEL_MODELS_WGRAD_FUSION=1``; read
when DDP is built): measured on an H100 (docs/PERFORMANCE.md, "Fused weight-gradient
accumulation") cuBLAS's beta = 1 kernels with an fp32 output are slower than a bf16 GEMM plus
the separate add (Llama-3-8B shape, 4096 tokens: 351.8 vs 342.6 ms a step; 0.89B shape: even),
so the default keeps megatron's unfused path. On, it runs on the CPU as an fp32 ``addmm_``
(which the tests use).

``enable(chunks)`` applies the setting to the DDP-wrapped model chunks after
``wrap_for_training`` made their grad buffers: it registers these functions where megatron's
linears look for the extension and sets ``gradient_accumulation_fusion`` on each megatron linear
that owns its weight (a tied LM head borrows the embedding's weight, whose other gradient still
arrives through ``.grad``, so it keeps the unfused path).
"""

from __future__ import annotations

import functools
import types

import torch

from parallel_models.options import option



def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor,
                main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (2-D: tokens x out, tokens x in)."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype,
                    out=main_grad)
    else:  # no mixed-dtype GEMM on the CPU: same math in the buffer's dtype
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


# the two entry points megatron-core's linears call (APEX's names and argument order)
extension = types.SimpleNamespace(wgrad_gemm_accum_fp32=_accumulate,
                                  wgrad_gemm_accum_fp16=_accumulate)


@functools.lru_cache(maxsize=None)
def fused_gemm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``_accumulate`` runs for ``dtype`` inputs on ``device_type`` and adds the product
    into the buffer in place (checked once on a small case against the fp32 reference)."""
    device = torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 24, generator=gen).to(device, dtype)
    g = torch.randn(48, 40, generator=gen).to(device, dtype)
    buf = torch.randn(40, 24, generator=gen).to(device)
    want = buf + g.float().t() @ x.float()
    try:
        _accumulate(x, g, buf)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.allclose(buf, want, rtol=1e-4, atol=1e-4))


def wanted(device_type: str, dtype: torch.dtype) -> bool:
    """On only with the option ``wgrad_fusion`` and where the fused GEMM works."""
    return option("wgrad_fusion") and fused_gemm_works(device_type, dtype)


def _install() -> None:
    from megatron.core.tensor_parallel import layers
    layers.fused_weight_gradient_mlp_cuda = extension
    layers._grad_accum_fusion_available = True


def enable(chunks, on: bool | None = None) -> int:
    """Fuse (``on``: None = as :func:`wanted` says; False turns it back off, for benchmarks that
    compare) the weight-gradient accumulation of every megatron linear in ``chunks``
    (DDP-wrapped: their weights have ``main_grad``) that owns its weight; returns how many
    linears were switched."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    chunks = list(chunks)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    if not params:
        return 0
    if on is None:
        if not wanted(params[0].device.type, params[0].dtype):
            return 0  # megatron built the linears unfused: nothing to switch
        on = True
    if on:
        _install()
    owners: dict[int, int] = {}
    for c in chunks:
        for m in c.modules():
            for p in m.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
    switched = 0
    for c in chunks:
        for m in c.modules():
            w = getattr(m, "weight", None)
            if (isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and w is not None
                    and w.requires_grad and hasattr(w, "main_grad") and owners.get(id(w)) == 1):
                m.gradient_accumulation_fusion = on
                switched += 1
    return switched
