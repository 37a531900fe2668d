"""The rollout engine's collection point for MoE routes: after the prefill and after every
decode step it copies the top-k experts each MoE router chose (``router_replay.last_routes``)
and at the end lays them out like the generated batch, ``[B, P + R, moe_layers, k]`` in the
compact dtype of ``parallel_models.utils.routes``, aligned with ``GenerationOutput.sequences``
(left-padded prompt, right-padded response). The last generated token of a row never goes
through the model, so its route is missing, as are the padding positions.
"""

from __future__ import annotations

import torch

from parallel_models.llama.layers import router_replay
from parallel_models.utils import routes as route_utils


class RouteCollector:
    def __init__(self, model):
        config = model.config
        if not config.is_moe:
            raise ValueError(f"{config.architecture} has no MoE layer: there are no routes to "
                             "record")
        self.model = model
        self.num_layers = len(config.moe_layer_ids)
        self.num_experts = config.num_experts
        self.prefill_routes: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _take(self) -> torch.Tensor:
        routes = router_replay.last_routes(self.model, self.num_layers)
        return route_utils.compact(routes, self.num_experts)

    def prefill(self) -> None:
        self.prefill_routes = self._take()

    def step(self) -> None:
        self.steps.append(self._take())

    def assemble(self, prompt_lengths: list[int], response_mask: torch.Tensor) -> torch.Tensor:
        """-> ``[B, P + R, layers, k]``; ``response_mask`` ``[B, R]`` (1 = a real token)."""
        batch, resp = response_mask.shape
        p_max = max(prompt_lengths)
        k = self.prefill_routes.shape[-1]
        dtype, device = self.prefill_routes.dtype, self.prefill_routes.device
        out = route_utils.missing_like((batch, p_max + resp, self.num_layers, k), dtype, device)
        start = 0
        for b, n in enumerate(prompt_lengths):
            out[b, p_max - n:p_max] = self.prefill_routes[start:start + n]
            start += n
        for s, step in enumerate(self.steps[:resp]):  # decode step s fed response token s
            out[:, p_max + s] = step
        missing = torch.full_like(out, route_utils.missing_value(dtype))
        real = response_mask.bool().to(device)[:, :, None, None]
        out[:, p_max:] = torch.where(real, out[:, p_max:], missing[:, p_max:])
        return out
