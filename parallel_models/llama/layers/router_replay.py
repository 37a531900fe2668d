"""Router replay for the MoE layers: record the top-k experts every token was routed to, and
route later forwards along a given record instead of the router's own top-k.

megatron-core (0.16 and later) has the seam: a ``TopKRouter`` with a ``router_replay`` object
hands its top-k choice to ``router_replay.get_replay_topk(scores, topk, ..., default)``
(``moe_utils.topk_routing_with_score_function``), which returns ``(probs, indices)``. Each of
our routers carries a :class:`RouteHook`, a subclass of megatron-core's ``RouterReplay`` that
is addressed per model (it leaves megatron's process-global list, so the actor, the reference
and the rollout model never see each other's records) and adds what RL needs:

- replay by *given* routes with a fallback: rows whose route is missing (-1: sequence-parallel
  padding, the last generated token, which the rollout never fed back) keep the router's own
  choice;
- the gate weights are the current router scores gathered at the replayed experts (then
  megatron's softmax over those k when ``pre_softmax`` is off), so gradients reach the router
  as without replay; where the replayed experts equal the router's own, the result is
  identical to no replay (same values, same gradients);
- every forward compares the router's own choice with the given routes (as sets) and counts
  the (token, layer) routes that differ *before* replay (``router/route_mismatch``);
- the routes used can be kept per forward (R2 records them in the old-log-prob forward) or
  read after each step (``last``, the rollout engine's collection point; a CUDA graph's
  captured tensor is rewritten by every replay, so this works inside graphs too).

Token layout: a route record of one forward is packed ``[tokens, moe_layers, k]`` in the
model's packed token order. Under sequence parallel each TP rank routes rows
``[rank * n, (rank + 1) * n)`` of the padded token sequence; the hook cuts its rows itself,
and recorded routes are gathered over the TP group. A pipeline stage only has its own layers:
it replays their columns and records missing routes (-1) for the others. The TP and pipeline
groups are those of the ``ParallelLayout`` the model was built in.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay

from parallel_models.parallel_layout import ParallelLayout, layout_of

from parallel_models.utils.routes import MISSING, expand


class RouteHook(RouterReplay):
    """The replay object of one router (one MoE layer, ``moe_index`` among the model's)."""

    def __init__(self, moe_index: int, sequence_parallel: bool, layout: ParallelLayout):
        super().__init__()
        # megatron keeps every instance in a process-global list for its static API; we address
        # routers per model, and a global list would keep dead models' records alive
        RouterReplay.global_router_replay_instances.remove(self)
        self.moe_index = moe_index
        self.sequence_parallel = sequence_parallel
        self.layout = layout
        self.targets: collections.deque = collections.deque()  # per forward: [tokens, k] int64
        self.replay = False
        self.kept: list[torch.Tensor] | None = None  # per forward: the routes used (local rows)
        self.last: torch.Tensor | None = None
        self.differing = 0
        self.compared = 0

    def _local_rows(self, target: torch.Tensor, rows: int) -> torch.Tensor:
        tp = self.layout.tensor_parallel_size if self.sequence_parallel else 1
        start = self.layout.tensor_parallel_rank * rows if tp > 1 else 0
        padded = rows * tp
        if target.shape[0] < padded:
            target = torch.cat([target, target.new_full((padded - target.shape[0],
                                                         target.shape[1]), MISSING)])
        return target[start:start + rows]

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups, group_topk)
        used = own
        if self.targets:
            target = self._local_rows(self.targets.popleft(), scores.shape[0])
            target = target.to(device=own.device, dtype=own.dtype)
            if target.shape[1] != topk and bool((target < 0).all()):
                target = target[:, :1].expand(-1, topk)  # a forward without routes
            if target.shape[1] != topk:
                raise ValueError(f"router replay: routes have k={target.shape[1]}, the router "
                                 f"picks {topk} experts (MoE layer {self.moe_index})")
            valid = target[:, 0] >= 0
            differs = (target.sort(-1).values != own.sort(-1).values).any(-1) & valid
            self.differing = self.differing + differs.sum()  # tensors: no host sync per layer
            self.compared = self.compared + valid.sum()
            if self.replay:
                used = torch.where(valid[:, None], target, own)
                probs = scores.gather(1, used)
        if self.kept is not None:
            self.kept.append(used.detach())
        self.last = used
        return probs, used


def attach(router, moe_index: int, sequence_parallel: bool, layout: ParallelLayout) -> RouteHook:
    """Give ``router`` (a megatron ``TopKRouter``) its hook; called once per MoE layer."""
    hook = RouteHook(moe_index, sequence_parallel, layout)
    router.router_replay = hook
    return hook


def hooks(model) -> list[RouteHook]:
    """The route hooks of ``model`` (one model or its pipeline chunks), in MoE-layer order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = [m.router_replay for c in chunks for m in c.modules()
             if isinstance(getattr(m, "router_replay", None), RouteHook)]
    return sorted(found, key=lambda h: h.moe_index)


def is_moe(model) -> bool:
    return bool(hooks(model))


# ---- rollout: routes of the last forward ---------------------------------------------------------
def last_routes(model, num_moe_layers: int) -> torch.Tensor:
    """The routes of ``model``'s last forward, ``[tokens, num_moe_layers, k]`` int64 (a copy;
    run without sequence parallel, as the rollout engine does)."""
    hs = hooks(model)
    if any(h.last is None for h in hs):
        raise RuntimeError("last_routes: a router has not run yet")
    first = hs[0].last
    out = first.new_full((first.shape[0], num_moe_layers, first.shape[1]), MISSING)
    for h in hs:
        out[:, h.moe_index] = h.last
    return out


# ---- training forwards: replay and record over microbatches --------------------------------------
@dataclasses.dataclass
class RouteSession:
    """What a :func:`routing` block saw: per microbatch the routes used (``recorded``, packed
    ``[tokens, moe_layers, k]`` int64, when asked) and the route comparison counts."""

    recorded: list[torch.Tensor] | None = None
    differing: int = 0
    compared: int = 0

    @property
    def mismatch(self) -> float | None:
        return self.differing / self.compared if self.compared else None


def _gather_rows(rows: torch.Tensor, sequence_parallel: bool,
                 layout: ParallelLayout) -> torch.Tensor:
    tp = layout.tensor_parallel_size
    if not sequence_parallel or tp == 1:
        return rows
    parts = [torch.empty_like(rows) for _ in range(tp)]
    dist.all_gather(parts, rows.contiguous(), group=layout.tp_group)
    return torch.cat(parts)


def _sum_over_model_parallel(values: list[int], sequence_parallel: bool, device,
                             layout: ParallelLayout) -> list[int]:
    t = torch.stack([torch.as_tensor(v, device=device) for v in values]).double()
    if sequence_parallel and layout.tensor_parallel_size > 1:
        dist.all_reduce(t, group=layout.tp_group)
    if layout.pipeline_parallel_size > 1:
        dist.all_reduce(t, group=layout.pp_group)
    return [int(v) for v in t.tolist()]


@contextlib.contextmanager
def routing(model, routes: list[torch.Tensor | None] | None, token_counts: list[int], *,
            replay: bool = False, record: bool = False):
    """Forwards of ``len(token_counts)`` microbatches through ``model`` (its chunks) in this
    block follow ``routes`` (per microbatch packed ``[tokens, moe_layers, k]``, compact or
    int64; None = no routes for it) when ``replay``, and are compared with them in any case;
    ``record`` keeps the routes used. Yields a :class:`RouteSession`, filled when the block
    ends (counts summed over the TP and pipeline groups; every rank of them must take part).

    Each router takes one entry per forward, in microbatch order (megatron's schedules run the
    forwards of a stage in that order; no activation recomputation here)."""
    hs = hooks(model)
    session = RouteSession()
    first = (model if isinstance(model, (list, tuple)) else [model])[0]
    while not hasattr(first, "head_kind"):  # DDP / Float16Module wrappers
        first = first.module
    if not first.config.is_moe:
        yield session
        return
    sp = first.sequence_parallel  # (a pipeline stage may hold no MoE layer: it still counts)
    layout = layout_of(first)
    if routes is not None and len(routes) != len(token_counts):
        raise ValueError(f"router replay: {len(routes)} route records for {len(token_counts)} "
                         "microbatches")
    for h in hs:
        h.targets.clear()
        h.differing = h.compared = 0
        h.replay = replay
        h.kept = [] if record else None
        if routes is None:
            continue
        for r, n in zip(routes, token_counts):
            if r is None:
                target = torch.full((n, 1), MISSING, dtype=torch.long)
            else:
                if r.shape[0] != n:
                    raise ValueError(f"router replay: a microbatch of {n} tokens came with "
                                     f"routes for {r.shape[0]}")
                target = expand(r[:, h.moe_index])
            h.targets.append(target)
    try:
        yield session
        leftover = [h.moe_index for h in hs if h.targets]
        if leftover:
            raise RuntimeError(f"router replay: MoE layers {leftover} ran fewer forwards than "
                               "there were microbatches")
        device = next(first.parameters()).device
        session.differing, session.compared = _sum_over_model_parallel(
            [sum(h.differing for h in hs), sum(h.compared for h in hs)], sp, device, layout)
        if record:
            layers = len(first.config.moe_layer_ids)
            session.recorded = []
            for i, n in enumerate(token_counts):
                out = torch.full((n, layers, first.config.moe_top_k), MISSING, dtype=torch.long)
                for h in hs:
                    out[:, h.moe_index] = _gather_rows(h.kept[i], sp, layout)[:n].cpu()
                session.recorded.append(out)
    finally:
        for h in hs:
            h.targets.clear()
            h.replay = False
            h.kept = None
