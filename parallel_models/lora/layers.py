"""LoRA adapters on our tensor-parallel linears, added to the base output by a forward hook.

The base linear keeps its weight and its name; its adapters hang under it as ``.lora``
(:class:`ColumnLora` / :class:`RowLora`), one :class:`LoraAdapter` per PEFT projection
(``lora_A`` / ``lora_B`` as PEFT names them), so a fused layer keeps per-projection adapters:
``qkv_proj.lora.q_proj``, ``.k_proj``, ``.v_proj``; ``gate_up_proj.lora.gate_proj``, ``.up_proj``.

Tensor parallelism (``x``: the layer's input, ``s``: alpha / rank):
- column-parallel (qkv, gate-up): A is replicated, B is split like the output rows of its
  projection. ``u = A x`` on every rank; the backward of ``u`` is all-reduced over TP (each rank's
  B slice contributes), so A's gradient and the input gradient are whole on every rank. Under
  sequence parallel ``x`` is this rank's tokens: gathered first (as the base layer does), the
  gather's backward keeps this rank's slice of the (already whole) gradient.
- row-parallel (o, down): A is split like the input columns, B is replicated. ``u = A_local
  x_local`` is summed over TP (all-reduce; reduce-scatter of the tokens under sequence parallel,
  where B then sees this rank's tokens only and its gradient is marked ``sequence_parallel``, to
  be summed over TP like the norms').
The delta is added to the base layer's output (bias included) as PEFT does. ``enabled=False``
switches a layer's adapters off (the reference policy is the base model).
"""

from __future__ import annotations

import math

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)


class LoraAdapter(torch.nn.Module):
    """One projection's adapter: ``lora_A`` ``[rank, in(_local)]``, ``lora_B``
    ``[out(_local), rank]``, PEFT's names."""

    def __init__(self, in_features: int, rank: int, out_features: int, *, dtype, device):
        super().__init__()
        self.lora_A = torch.nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device)
        self.lora_B = torch.nn.Linear(rank, out_features, bias=False, dtype=dtype, device=device)


def init_full_a(rank: int, in_features: int, seed: int) -> torch.Tensor:
    """PEFT's initialization of A at its full size (kaiming-uniform, a=sqrt(5)), fp32, from a
    generator of its own: every TP rank draws the same matrix and cuts its slice."""
    a = torch.empty(rank, in_features)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    return a


class _LoraBase(torch.nn.Module):
    def __init__(self, base: torch.nn.Module, scale: float, dropout: float):
        super().__init__()
        self.scale = scale
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.enabled = True
        self.tp_group = base.tp_group
        self.tp = torch.distributed.get_world_size(self.tp_group) if (
            torch.distributed.is_initialized() and self.tp_group is not None) else 1
        self.sequence_parallel = bool(base.sequence_parallel) and self.tp > 1
        self.adapters = torch.nn.ModuleDict()

    def extra_repr(self) -> str:
        return f"scale={self.scale}, tp={self.tp}, sequence_parallel={self.sequence_parallel}"

    def merged_weights(self):
        """``(base weight, scale * B @ A)`` (local layout) for a merge."""
        yield self._base_weight, self.delta_weight()


class ColumnLora(_LoraBase):
    """Adapters of a column-parallel linear. ``blocks``: ``(projection, local rows)`` in the
    order of the layer's local output (``[q; k; v]`` or ``[gate; up]``)."""

    def __init__(self, base, blocks: list[tuple[str, int]], scale: float, dropout: float):
        super().__init__(base, scale, dropout)
        self.blocks = list(blocks)

    def add(self, name: str, rank: int, full_a: torch.Tensor) -> LoraAdapter:
        rows = dict(self.blocks)[name]
        w = self._base_weight
        ad = LoraAdapter(full_a.shape[1], rank, rows, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            ad.lora_A.weight.copy_(full_a)
            ad.lora_B.weight.zero_()
        set_tensor_model_parallel_attributes(ad.lora_B.weight, True, 0, 1)
        self.adapters[name] = ad
        return ad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                     group=self.tp_group)
        x = self.dropout(x)
        pieces = []
        for name, rows in self.blocks:
            ad = self.adapters[name] if name in self.adapters else None
            if ad is None:
                pieces.append(x.new_zeros(*x.shape[:-1], rows))
                continue
            u = ad.lora_A(x)
            if self.tp > 1:
                u = copy_to_tensor_model_parallel_region(u, group=self.tp_group)
            pieces.append(ad.lora_B(u) * self.scale)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` in the local layout of the base weight (zeros where no adapter)."""
        w = self._base_weight
        out = []
        for name, rows in self.blocks:
            if name in self.adapters:
                ad = self.adapters[name]
                out.append(ad.lora_B.weight @ ad.lora_A.weight * self.scale)
            else:
                out.append(w.new_zeros(rows, w.shape[1]))
        return torch.cat(out, dim=0)


class RowLora(_LoraBase):
    """The adapter of a row-parallel linear (one projection: ``o_proj`` / ``down_proj``)."""

    def __init__(self, base, name: str, scale: float, dropout: float):
        super().__init__(base, scale, dropout)
        self.name = name

    def add(self, name: str, rank: int, full_a: torch.Tensor, tp_rank: int) -> LoraAdapter:
        w = self._base_weight
        per = w.shape[1]
        ad = LoraAdapter(per, rank, w.shape[0], dtype=w.dtype, device=w.device)
        with torch.no_grad():
            ad.lora_A.weight.copy_(full_a[:, tp_rank * per:(tp_rank + 1) * per])
            ad.lora_B.weight.zero_()
        set_tensor_model_parallel_attributes(ad.lora_A.weight, True, 1, 1)
        if self.sequence_parallel:
            ad.lora_B.weight.sequence_parallel = True
        self.adapters[name] = ad
        return ad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ad = self.adapters[self.name]
        u = ad.lora_A(self.dropout(x))
        if self.sequence_parallel:
            u = reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
        elif self.tp > 1:
            u = reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        return ad.lora_B(u) * self.scale

    def delta_weight(self) -> torch.Tensor:
        ad = self.adapters[self.name]
        return ad.lora_B.weight @ ad.lora_A.weight * self.scale


def _add_delta(module, args, output):
    """Forward hook of a linear with adapters: ``(out, bias)`` -> ``(out + delta, bias)``."""
    lora = module.lora
    if not lora.enabled:
        return output
    out, bias = output
    return out + lora(args[0]).to(out.dtype), bias


def attach(base: torch.nn.Module, lora: _LoraBase) -> None:
    """Hang ``lora`` under ``base`` as ``base.lora`` and add its delta to ``base``'s output."""
    object.__setattr__(lora, "_base_weight", base.weight)  # not a submodule / parameter
    base.lora = lora
    base.register_forward_hook(_add_delta)
