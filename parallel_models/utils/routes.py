"""Routing records of MoE models as tensors: the top-k expert indices each token was sent to,
``[rows, seq, moe_layers, k]`` aligned with a batch's ``sequences`` (or packed ``[tokens,
moe_layers, k]``), in the most compact integer dtype that holds the expert count.

A route that was never computed (padding, the last generated token, which no forward saw, or
the MoE layers of another pipeline stage) is *missing*: -1 once expanded to int64, the dtype's
``missing_value`` while compact (255 in uint8). Router replay (``llama/layers/router_replay``)
lets the router choose by itself wherever a route is missing.
"""

from __future__ import annotations

import torch

MISSING = -1


def route_dtype(num_experts: int) -> torch.dtype:
    """uint8 up to 255 experts (255 = missing), int16 up to 32767, else int32."""
    if num_experts <= 255:
        return torch.uint8
    if num_experts <= 32767:
        return torch.int16
    return torch.int32


def missing_value(dtype: torch.dtype) -> int:
    return 255 if dtype == torch.uint8 else MISSING


def compact(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 expert indices (-1 = missing) -> the compact dtype of ``num_experts``."""
    dtype = route_dtype(num_experts)
    if dtype == torch.uint8:
        indices = torch.where(indices < 0, torch.full_like(indices, 255), indices)
    return indices.to(dtype)


def expand(routes: torch.Tensor) -> torch.Tensor:
    """Compact routes -> int64 with -1 where missing."""
    out = routes.long()
    if routes.dtype == torch.uint8:
        out = torch.where(out == 255, torch.full_like(out, MISSING), out)
    return out


def missing_like(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A route tensor of ``shape`` with every route missing."""
    return torch.full(tuple(shape), missing_value(dtype), dtype=dtype, device=device)


def pad_sequence_axis(routes: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Pad ``[rows, seq, layers, k]`` routes along ``seq`` with missing routes."""
    if not left and not right:
        return routes
    n, _, layers, k = routes.shape
    parts = [missing_like((n, left, layers, k), routes.dtype, routes.device), routes,
             missing_like((n, right, layers, k), routes.dtype, routes.device)]
    return torch.cat(parts, dim=1)


def share_differing(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(token, layer) routes present in both ``a`` and ``b`` (int64, same shape ``[..., k]``)
    whose expert *sets* differ, and how many were compared."""
    valid = (a[..., 0] >= 0) & (b[..., 0] >= 0)
    differs = (a.sort(-1).values != b.sort(-1).values).any(-1) & valid
    return int(differs.sum()), int(valid.sum())
