"""MoE routes in the PPO roles: the bridge between a batch's ``routes`` column (``[B, P+R,
moe_layers, k]``, compact dtype, aligned with ``sequences``) and the router hooks of
``parallel_models.llama.layers.router_replay``.

``make_microbatches`` packs each microbatch's routes like its tokens (``[tokens, layers, k]``);
:func:`routed_forwards` takes them off the microbatches (they are not model inputs) and runs a
block of forwards that replay them (``replay=True``), record the routes used (``record``) and,
whenever routes are given, count the routes the router would have chosen differently
(``router/route_mismatch``, measured before replay). :func:`recorded_routes` lays a record back
out like the batch (rows in batch order).
"""

from __future__ import annotations

import contextlib

import torch

from parallel_models.llama.layers import router_replay
from parallel_models.utils import routes as route_utils
from parallel_models.utils.microbatch import restore_order


def pack_routes(routes: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, T, layers, k]`` -> packed ``[tokens, layers, k]`` in ``pack_padded_batch``'s order."""
    return routes[attention_mask.bool()]


@contextlib.contextmanager
def routed_forwards(chunks, microbatches: list[dict], *, replay: bool = False,
                    record: bool = False):
    """Forwards of ``microbatches`` in this block follow / compare with / record routes (see the
    module doc); yields the :class:`router_replay.RouteSession`. Removes ``"routes"`` from the
    microbatches."""
    routes = [mb.pop("routes", None) for mb in microbatches]
    if replay and any(r is None for r in routes):
        raise ValueError("router replay is on but the batch carries no routes (the rollout did "
                         "not record them: an MoE actor records them in-process, the rollout "
                         "server when asked with return_routes)")
    counts = [int(mb["cu_seqlens"][-1]) for mb in microbatches]
    given = routes if any(r is not None for r in routes) else None
    with router_replay.routing(chunks, given, counts, replay=replay, record=record) as session:
        yield session


def recorded_routes(session, microbatches: list[dict], indices, num_experts: int
                    ) -> torch.Tensor:
    """A session's recorded routes as ``[B, P+R, layers, k]`` (compact, batch row order)."""
    rows = []
    for packed, mb in zip(session.recorded, microbatches):
        mask = mb["attention_mask"].bool().cpu()
        out = torch.full((*mask.shape, *packed.shape[1:]), route_utils.MISSING, dtype=torch.long)
        out[mask] = packed
        rows.append(route_utils.compact(out, num_experts))
    return restore_order(rows, indices).to(microbatches[0]["attention_mask"].device)
