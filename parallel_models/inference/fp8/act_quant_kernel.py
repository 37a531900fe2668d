"""The FP8 rollout's activation quantization as one Triton kernel (CUDA; imported lazily:
triton is not a dependency): per token and 128-wide group of the input features, ``scale =
amax / 448`` (1 for an all-zero group), ``q = e4m3(clamp(x * (1 / scale)))``, the scales written
straight into the token-major (column-major, token count padded to 4) layout
``torch._scaled_mm``'s 1 x 128 block-wise mode reads. The torch version
(``quantize.quantize_activation`` + ``gemm._token_major``) takes about eleven kernels per linear,
which at decode batch sizes cost more than the GEMM they feed; this is one.
``gemm`` checks it against the torch version once per device before using it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel_models.inference.fp8.quantize import BLOCK, E4M3, E4M3_MAX


@triton.jit
def _quantize_groups_kernel(X, Q, S, n_cols, stride_x, stride_q, ld_s,
                            FP8_MAX: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)  # (`/`: approximate)
    # times the correctly rounded reciprocal, as quantize_activation and the decode kernels do
    # (Triton's ``x / scale`` is an approximate division, and a division rounds exact ties apart)
    q = x * tl.math.div_rn(1.0, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + group * ld_s + row, scale)


def quantize_token_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[tokens, in]`` (CUDA, any float dtype, unit stride along ``in``) -> (e4m3
    ``[tokens, in]``, fp32 scales ``[tokens, ceil(in/128)]`` stored token-major)."""
    tokens, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    groups = -(-cols // BLOCK)
    ld = -(-max(tokens, 1) // 4) * 4
    q = torch.empty(tokens, cols, dtype=E4M3, device=x.device)
    storage = torch.empty(groups, ld, dtype=torch.float32, device=x.device)
    if tokens:
        _quantize_groups_kernel[(tokens, groups)](x, q, storage, cols, x.stride(0), q.stride(0),
                                                  ld, FP8_MAX=E4M3_MAX, GROUP=BLOCK,
                                                  num_warps=1)
    return q, storage[:, :tokens].t()


__all__ = ["quantize_token_groups"]
