"""How the load-balancing loss's running totals (``moe_aux_loss.RouterTotals``) travel between
pipeline stages: as extra rows at the end of the activation ``[tokens(/tp), 1, hidden]`` a
stage sends on, which the next stage strips before its layers.

Why rows of the activation: megatron-core's schedules run a microbatch's forward on each stage
at a different time, so a collective over the pipeline group inside the forward would deadlock;
the activation is the one message that goes from stage to stage for that microbatch, and its
gradient is the one that comes back. Autograd then does the rest: the last stage's loss is
linear in the probability sums, so the gradient arriving on the carried sums is E * C / R^2 with
the whole model's counts, and it flows through the p2p into every earlier stage's routers.

Exactness in the pipeline dtype (each TP rank carries its own share under sequence parallel):
- probability sums (fp32, with gradient): as themselves in an fp32 pipeline; in a bf16 one as
  three bf16 pieces ``hi + mid + lo`` (8 significant bits each: fp32's 24), and their gradient
  comes back split the same way (custom autograd on both ends), so neither is rounded;
- counts and row counts (int64, no gradient): five base-256 digits each, exact in any float
  dtype with 8 significant bits (below 2^40 assignments per microbatch).
Row layout: ``[pieces x E | digits x E counts | digits x 1 rows | zeros]``, cut into rows of
``hidden`` values (one row for E up to hidden / 8).
"""

from __future__ import annotations

import math

import torch

from parallel_models.config import ConfigError
from parallel_models.llama.layers.moe_aux_loss import RouterTotals

BASE = 256
DIGITS = 5


def _pieces(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return 1
    if dtype == torch.bfloat16:
        return 3
    raise ConfigError(f"the MoE load-balancing loss under pipeline parallel needs an fp32 or bf16 "
                      f"pipeline dtype, not {dtype}")


def carry_rows(num_experts: int, hidden_size: int, dtype: torch.dtype) -> int:
    """How many activation rows carry the totals of a model with ``num_experts`` experts."""
    width = _pieces(dtype) * num_experts + DIGITS * (num_experts + 1)
    return math.ceil(width / hidden_size)


def _split(x: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    """fp32 ``x`` as ``n`` pieces of ``dtype`` whose sum is ``x`` (``[n, *x.shape]``)."""
    out, rest = [], x.float()
    for _ in range(n):
        piece = rest.to(dtype)
        out.append(piece)
        rest = rest - piece.float()
    return torch.stack(out)


def _join(pieces: torch.Tensor) -> torch.Tensor:
    return pieces.double().sum(0).float()  # the pieces' sum is exact in float64


class _ToPieces(torch.autograd.Function):
    """fp32 sums -> pieces of the pipeline dtype; backward: the pieces of the gradient, joined."""

    @staticmethod
    def forward(ctx, x, dtype, n):
        return _split(x, dtype, n)

    @staticmethod
    def backward(ctx, grad):
        return _join(grad), None, None


class _FromPieces(torch.autograd.Function):
    """Pieces -> fp32 sums; backward: the fp32 gradient split into pieces of their dtype."""

    @staticmethod
    def forward(ctx, pieces):
        ctx.dtype, ctx.n = pieces.dtype, pieces.shape[0]
        return _join(pieces)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dtype, ctx.n)


def _digits(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = values.detach().long()
    return torch.stack([(values // BASE ** i) % BASE for i in range(DIGITS)], dim=-1).to(dtype)


def _undigits(digits: torch.Tensor) -> torch.Tensor:
    digits = digits.detach().float().round().long()
    scale = torch.tensor([BASE ** i for i in range(DIGITS)], device=digits.device)
    return (digits * scale).sum(-1)


def append(hidden: torch.Tensor, totals: RouterTotals) -> torch.Tensor:
    """``hidden [t, 1, h]`` with the carry rows of ``totals`` appended: ``[t + rows, 1, h]``."""
    dtype, h = hidden.dtype, hidden.shape[-1]
    num_experts = totals.probs.shape[0]
    n = _pieces(dtype)
    parts = [_ToPieces.apply(totals.probs, dtype, n).reshape(-1),
             _digits(totals.counts, dtype).reshape(-1), _digits(totals.rows, dtype).reshape(-1)]
    k = carry_rows(num_experts, h, dtype)
    width = sum(p.numel() for p in parts)
    parts.append(hidden.new_zeros(k * h - width))
    rows = torch.cat([p.to(hidden.device) for p in parts]).view(k, 1, h)
    return torch.cat([hidden, rows], dim=0)


def strip(received: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, RouterTotals]:
    """The activation a stage received, split into the hidden rows and the previous stages'
    totals (the inverse of :func:`append`)."""
    dtype, h = received.dtype, received.shape[-1]
    n = _pieces(dtype)
    k = carry_rows(num_experts, h, dtype)
    if received.shape[0] < k:
        raise RuntimeError(f"the received activation has {received.shape[0]} rows, fewer than the "
                           f"{k} that carry the MoE load-balancing totals: is the previous stage "
                           "recording router logits too?")
    hidden, flat = received[:-k], received[-k:].reshape(-1)
    probs = _FromPieces.apply(flat[:n * num_experts].view(n, num_experts))
    digits = flat[n * num_experts:(n + DIGITS) * num_experts + DIGITS].view(num_experts + 1, DIGITS)
    counts_rows = _undigits(digits)
    return hidden, RouterTotals(counts_rows[:num_experts], probs, counts_rows[num_experts:])
