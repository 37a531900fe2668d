"""The reference policy of a LoRA actor: the actor's own model with its adapters switched off
(the base model is the initial policy), so the run holds one copy of the base weights.

It shares the actor's weights: ``offload`` / ``onload`` move nothing of their own, ``on_device``
brings the actor's weights (not its optimizer states) for the reference phase. On the megatron
backend the adapters are switched off by ``parallel_models.lora.adapters_disabled``; on the fsdp
backend by peft's ``disable_adapter()`` context (``disabled``).
"""

from __future__ import annotations

import torch


class AdapterFreeReference:
    """``log_probs`` of the actor role's model with every adapter off. The actor's own
    ``route_session`` / ``recorded_routes`` (MoE) are left as its last forward set them.
    ``disabled``: a context manager factory switching the actor's adapters off (default: ours,
    on the actor's model chunks)."""

    def __init__(self, actor, disabled=None):
        self.actor = actor
        if disabled is None:
            from parallel_models.lora.apply import adapters_disabled

            disabled = lambda: adapters_disabled(actor.chunks)  # noqa: E731
        self.disabled = disabled

    @property
    def model(self):
        return self.actor.model

    def offload(self) -> int:
        return 0

    def onload(self) -> int:
        return 0

    def on_device(self, with_optimizer: bool = False):
        return self.actor.on_device(with_optimizer=False)

    @torch.no_grad()
    def log_probs(self, batch, replay: bool = False, record: bool = False) -> torch.Tensor:
        actor = self.actor
        if not hasattr(actor, "route_session"):  # the fsdp roles: no routes, no replay
            with self.disabled():
                return actor.log_probs(batch)
        kept = actor.route_session, actor.recorded_routes
        try:
            with self.disabled():
                out = actor.log_probs(batch, replay=replay, record=record)
            self.route_session, self.recorded_routes = actor.route_session, actor.recorded_routes
        finally:
            actor.route_session, actor.recorded_routes = kept
        return out

    route_session = None
    recorded_routes = None
