"""Actor, reference and critic of the fsdp backend: the megatron roles' API (``log_probs``,
``values``, ``update``, ``offload`` / ``onload`` / ``on_device``) over FSDP2-sharded HF models,
with the same microbatches, losses and metrics (``rl/roles/model_roles.py``'s ``policy_loss`` /
``value_loss`` / ``_global_update_metrics``).

Gradients: each microbatch's ``loss * denom`` is divided by the global denominator (summed over
microbatches and ranks) and multiplied by the data-parallel size, because FSDP averages the
gradients over the mesh; the sum is then the gradient of the global token (or sequence) mean,
as the megatron backend's per-token loss. Every rank runs the same number of forwards /
backwards (FSDP all-gathers in each): a rank with fewer microbatches repeats its first one with
a zero loss weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_models.rl.algorithms import losses
from parallel_models.rl.backends.fsdp.forward import forward_packed_order, global_sum, synced_count
from parallel_models.rl.backends.fsdp.offload import FSDPOffloader
from parallel_models.rl.backends.fsdp.optim import fsdp_optimizer_step
from parallel_models.rl.roles.model_roles import (VALUE_METRIC_WEIGHTS, _global_update_metrics,
                                      _response_log_probs, gather_values, make_microbatches,
                                      policy_loss, policy_metric_weights, value_loss)
from parallel_models.utils.microbatch import restore_order
from parallel_models.utils.offload import OffloadingRole


def _to(mb: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}


class _FSDPRole(OffloadingRole):
    """What the fsdp roles share: microbatches on the device, forwards in step with the other
    ranks, one optimizer step over a minibatch, offloading."""

    def __init__(self, model, train_state, max_tokens: int, packed: bool):
        self.model = model
        self.state = train_state
        self.max_tokens = max_tokens
        self.packed = packed
        self.version = 0  # optimizer steps taken (the rollout engine refills when it moves)
        self.offloader = FSDPOffloader(model, train_state.optimizer if train_state else None)

    @property
    def device(self) -> torch.device:
        return self.offloader.device

    def _microbatches(self, batch) -> tuple[list[dict], list[list[int]], int]:
        mbs, indices = make_microbatches(batch, self.max_tokens)
        return [_to(mb, self.device) for mb in mbs], indices, synced_count(len(mbs), self.device)

    @torch.no_grad()
    def _forward_all(self, batch, read) -> torch.Tensor:
        mbs, indices, count = self._microbatches(batch)
        outs = []
        for i in range(count):
            mb = mbs[min(i, len(mbs) - 1)]
            out = read(forward_packed_order(self.model, mb, self.packed), mb)
            if i < len(mbs):
                outs.append(out.cpu())
        # on the batch's device, as the megatron roles return them (the trainer mixes both)
        return restore_order(outs, indices).to(batch["response_mask"].device)

    def _train(self, batch, loss_fn, mode: str, weights: dict, prefix: str) -> dict[str, float]:
        """One optimizer step on ``batch``; ``loss_fn(output, mb) -> (loss * denom, denom,
        metrics)`` with ``mode``'s denominator. Metrics like the megatron roles' (global
        weighted means, grad_norm, lr)."""
        mbs, _, count = self._microbatches(batch)
        # the global denominator depends on the masks only: known before any forward
        local = sum(float(losses.agg_denominator(mb["response_mask"], mode)) for mb in mbs)
        total = global_sum(local, self.device)
        scale = (dist.get_world_size() if dist.is_initialized() else 1) / max(total, 1e-30)
        sums: dict[str, float] = {}
        for i in range(count):
            mb = mbs[min(i, len(mbs) - 1)]
            weighted_loss, _, metrics = loss_fn(forward_packed_order(self.model, mb, self.packed),
                                                mb)
            real = i < len(mbs)
            (weighted_loss * (scale if real else 0.0)).backward()
            if real:
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        out = fsdp_optimizer_step(self.state)
        self.version += 1
        out.update(sums)
        return _global_update_metrics(out, weights, 1, prefix)


class FSDPPolicyRole(_FSDPRole):
    """Actor (with an ``optim.FSDPTrainState`` and its ``actor`` config section) or reference
    (frozen) over a sharded HF causal LM."""

    def __init__(self, model, train_state=None, temperature: float = 1.0, max_tokens: int = 4096,
                 cfg=None, packed: bool = True):
        super().__init__(model, train_state, max_tokens, packed)
        self.temperature = temperature
        self.cfg = cfg

    def log_probs(self, batch) -> torch.Tensor:
        return self._forward_all(
            batch, lambda logits, mb: _response_log_probs(logits, mb, self.temperature, False)[0])

    def update(self, batch) -> dict[str, float]:
        cfg = self.cfg
        return self._train(batch, lambda logits, mb: policy_loss(logits, mb, cfg, self.temperature),
                           cfg.loss_agg_mode, policy_metric_weights(cfg), "actor/")


class FSDPCriticRole(_FSDPRole):
    """Value model (``models.ValueModel``, sharded): values of the states before each response
    token."""

    def __init__(self, model, train_state, max_tokens: int = 4096, cfg=None,
                 loss_agg_mode: str = "token-mean", packed: bool = True):
        super().__init__(model, train_state, max_tokens, packed)
        self.cfg = cfg
        self.loss_agg_mode = loss_agg_mode

    def values(self, batch) -> torch.Tensor:
        return self._forward_all(batch, gather_values)

    def update(self, batch) -> dict[str, float]:
        mode = self.loss_agg_mode
        return self._train(batch, lambda values, mb: value_loss(values, mb,
                                                                self.cfg.cliprange_value, mode),
                           mode, VALUE_METRIC_WEIGHTS, "critic/")
