"""The reference policy of a LoRA actor: the actor's own model with its adapters switched off
(the base model is the initial policy), so the run holds one copy of the base weights.

It shares the actor's weights: ``offload`` / ``onload`` move nothing of their own, ``on_device``
brings the actor's weights (not its optimizer states) for the reference phase.
"""

from __future__ import annotations

import torch

from parallel_models.lora.apply import adapters_disabled


class AdapterFreeReference:
    """``log_probs`` of the actor role's model with every adapter off. The actor's own
    ``route_session`` / ``recorded_routes`` (MoE) are left as its last forward set them."""

    def __init__(self, actor):
        self.actor = actor

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
        kept = actor.route_session, actor.recorded_routes
        try:
            with adapters_disabled(actor.chunks):
                out = actor.log_probs(batch, replay=replay, record=record)
            self.route_session, self.recorded_routes = actor.route_session, actor.recorded_routes
        finally:
            actor.route_session, actor.recorded_routes = kept
        return out

    route_session = None
    recorded_routes = None
