"""Per-expert LoRA on an MoE layer's routed experts: PEFT's ``ParamWrapper`` on transformers'
fused expert parameters (``LoraConfig(target_parameters=[...])``: ``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``).

PEFT's math (``peft/tuners/lora/layer.py``, ``ParamWrapper.get_delta_factors``): ``lora_A``
``[E * r, in]`` and ``lora_B`` ``[out, r * E]``; expert ``e``'s factors are
``A_e = A.reshape(E, r, in)[e]`` and ``B_e = B.reshape(out, r, E)[:, :, e]``, and the experts run
with ``W_e + alpha / r * B_e @ A_e`` (a parametrization of the fused parameter). Here each
expert projection's output gets ``alpha / r * B_e (A_e x)`` for that expert's tokens: the same
function (the projections are linear in their weight), the same gradients. PEFT nests the two
wrappers in parameter order: with both targeted, ``gate_up_proj``'s adapters are saved under
``mlp.experts.base_layer.lora_*`` and ``down_proj``'s under ``mlp.experts.lora_*``; a single one
under ``mlp.experts.lora_*``. PEFT refuses dropout on these adapters.

Our layout: ``lora_A`` ``[local experts, r, in(_local)]``, ``lora_B`` ``[local experts,
out(_local), r]``; local expert ``e`` is global expert ``ep_rank * local + e``
(:func:`to_peft` / :func:`from_peft` convert full tensors). Expert tensor parallelism (the ETP
ranks of an expert see the same tokens; fc1 is column- and fc2 row-parallel with no
communication inside; megatron-core's dispatcher sums the ranks' input gradients and fc2
outputs):
- ``gate_up_proj`` (fc1): A replicated, B split like fc1's local rows (``[gate slice; up
  slice]``). Each rank's share of x's gradient is partial (the dispatcher sums them); A's
  gradient is partial too and is all-reduced over the ETP group (megatron's
  ``copy_to_tensor_model_parallel_region`` on A).
- ``down_proj`` (fc2): A split like fc2's input columns, B replicated. Each rank adds
  ``B (A_local x_local)``, a partial sum the dispatcher adds up; B's gradient is all-reduced.
Both ways the experts compute (megatron-core's loop over experts, our grouped GEMMs in
``llama/layers/grouped_experts.py``) call :meth:`ExpertLora.delta` / :meth:`grouped_delta`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

# our projection -> (the expert MLP's linear, PEFT's target parameter)
PROJECTIONS = {"gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}
TARGET_PARAMETERS = {"gate_up_proj": "mlp.experts.gate_up_proj",
                     "down_proj": "mlp.experts.down_proj"}


def peft_module(projections, proj: str) -> str:
    """PEFT's module path (under the layer) of ``proj``'s adapters when ``projections`` are
    targeted: the nested ``ParamWrapper``s (gate_up inner, down outer)."""
    nested = len(projections) == 2 and proj == "gate_up_proj"
    return "mlp.experts.base_layer" if nested else "mlp.experts"


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() and group is not None else 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() and group is not None else 0


class _Factor(torch.nn.Module):
    """A holder of one factor (``.weight``), so an expert adapter reads like PEFT's
    (``lora_A.weight`` / ``lora_B.weight``)."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(tensor)


class ExpertAdapter(torch.nn.Module):
    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.lora_A = _Factor(a)
        self.lora_B = _Factor(b)


class ExpertLora(torch.nn.Module):
    """The adapters of one MoE layer's local experts (``experts.lora``)."""

    def __init__(self, experts: torch.nn.Module, scale: float):
        super().__init__()
        self.scale = scale
        self.enabled = True
        self.num_local = experts.num_local_experts
        self.tp_group, self.ep_group = experts.tp_group, experts.ep_group
        self.tp, self.tp_rank = _size(self.tp_group), _rank(self.tp_group)
        self.ep, self.ep_rank = _size(self.ep_group), _rank(self.ep_group)
        self.adapters = torch.nn.ModuleDict()
        self._current: dict | None = None  # the factors of the forward in progress
        object.__setattr__(self, "_experts", experts)  # not a submodule

    def extra_repr(self) -> str:
        return f"scale={self.scale}, experts={self.num_local}x{self.ep}, tp={self.tp}"

    def linear(self, proj: str, e: int) -> torch.nn.Module:
        return getattr(self._experts.local_experts[e], PROJECTIONS[proj])

    def add(self, proj: str, rank: int, full_a: torch.Tensor) -> ExpertAdapter:
        """``proj``'s adapters from PEFT's full ``lora_A`` ``[E * r, in]`` (this rank's experts,
        and its input columns for ``down_proj``); B zero."""
        w = self.linear(proj, 0).weight
        a = full_a.view(-1, rank, full_a.shape[-1])
        a = a[self.ep_rank * self.num_local:(self.ep_rank + 1) * self.num_local]
        if proj == "down_proj" and self.tp > 1:
            a = a.chunk(self.tp, dim=2)[self.tp_rank]
        ad = ExpertAdapter(a.to(device=w.device, dtype=w.dtype).clone(),
                           w.new_zeros(self.num_local, w.shape[0], rank))
        split, dim = (ad.lora_B.weight, 1) if proj == "gate_up_proj" else (ad.lora_A.weight, 2)
        set_tensor_model_parallel_attributes(split, True, dim, 1)
        for p in ad.parameters():
            p.allreduce = False  # expert parameters: gradients reduced over expert-DP
        self.adapters[proj] = ad
        for e in range(self.num_local):
            self.linear(proj, e).register_forward_hook(_expert_hook(self, proj, e))
        return ad

    def _factors(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        ad = self.adapters[proj]
        a, b = ad.lora_A.weight, ad.lora_B.weight
        if self.tp > 1:  # the replicated factor: its gradient summed over the ETP ranks
            if proj == "gate_up_proj":
                a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            else:
                b = copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        return a, b

    def begin(self) -> None:
        """Before the experts' forward: the factors, once for all experts."""
        self._current = ({p: self._factors(p) for p in self.adapters}
                         if self.enabled else None)

    def end(self) -> None:
        self._current = None

    def active(self, proj: str) -> bool:
        return self._current is not None and proj in self._current

    def delta(self, proj: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e``'s ``scale * B_e (A_e x)`` for its tokens ``x``."""
        a, b = self._current[proj]
        return (x @ a[e].t()) @ b[e].t() * self.scale

    def grouped_delta(self, proj: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """:meth:`delta` of every local expert at once (tokens sorted by expert, ``offs`` the
        grouped GEMM's cumulative counts)."""
        a, b = self._current[proj]
        if x.is_cuda and (a.shape[1] * x.element_size()) % 16:
            # the CUDA grouped GEMM wants 16-byte aligned rank strides: one matmul per expert
            counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
            parts = [self.delta(proj, e, t) for e, t in enumerate(torch.split(x, counts))]
            return torch.cat(parts) if parts else x.new_zeros(0, b.shape[1])
        u = torch._grouped_mm(x, a.transpose(1, 2), offs=offs)
        return torch._grouped_mm(u.contiguous(), b.transpose(1, 2), offs=offs) * self.scale

    def merged_weights(self):
        """``(expert weight, scale * B_e @ A_e)`` of every adapted local expert projection."""
        for proj, ad in self.adapters.items():
            for e in range(self.num_local):
                delta = ad.lora_B.weight[e] @ ad.lora_A.weight[e] * self.scale
                yield self.linear(proj, e).weight, delta

    # -- PEFT's full tensors <-> this rank's slices ---------------------------------------
    def gather_full(self, proj: str, which: str, local: torch.Tensor) -> torch.Tensor:
        """This rank's ``lora_A`` / ``lora_B`` (or its gradient) -> PEFT's full tensor
        (collective over the ETP and EP groups)."""
        t = local.detach().contiguous()
        split = {("gate_up_proj", "B"): 1, ("down_proj", "A"): 2}.get((proj, which))
        if split is not None and self.tp > 1:
            parts = _all_gather(t, self.tp_group, self.tp)
            t = _join_gate_up(parts) if proj == "gate_up_proj" else torch.cat(parts, dim=split)
        if self.ep > 1:
            t = torch.cat(_all_gather(t, self.ep_group, self.ep), dim=0)
        return to_peft(which, t)

    def local_slice(self, proj: str, which: str, full: torch.Tensor) -> torch.Tensor:
        """PEFT's full tensor -> this rank's slice in our layout."""
        rank = self.adapters[proj].lora_A.weight.shape[1]
        t = from_peft(which, full, rank)
        t = t[self.ep_rank * self.num_local:(self.ep_rank + 1) * self.num_local]
        if self.tp > 1 and (proj, which) == ("down_proj", "A"):
            t = t.chunk(self.tp, dim=2)[self.tp_rank]
        elif self.tp > 1 and (proj, which) == ("gate_up_proj", "B"):
            gate, up = t.chunk(2, dim=1)
            t = torch.cat([gate.chunk(self.tp, dim=1)[self.tp_rank],
                           up.chunk(self.tp, dim=1)[self.tp_rank]], dim=1)
        return t

    def full_count(self) -> int:
        """The full (PEFT) size of these adapters."""
        n = 0
        for proj, ad in self.adapters.items():
            a, b = ad.lora_A.weight.numel(), ad.lora_B.weight.numel()
            n += (a * (self.tp if proj == "down_proj" else 1)
                  + b * (self.tp if proj == "gate_up_proj" else 1)) * self.ep
        return n


def _all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return parts


def _join_gate_up(parts: list[torch.Tensor]) -> torch.Tensor:
    """ETP ranks' ``[experts, (gate slice; up slice), r]`` -> ``[experts, (gate; up), r]``."""
    halves = [p.chunk(2, dim=1) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)


def to_peft(which: str, t: torch.Tensor) -> torch.Tensor:
    """Ours ``A [E, r, in]`` / ``B [E, out, r]`` -> PEFT's ``A [E*r, in]`` / ``B [out, r*E]``."""
    if which == "A":
        return t.reshape(-1, t.shape[-1])
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)


def from_peft(which: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    """The inverse of :func:`to_peft` (``rank``: r)."""
    if which == "A":
        return t.reshape(-1, rank, t.shape[-1])
    return t.reshape(t.shape[0], rank, -1).permute(2, 0, 1)


def _expert_hook(lora: ExpertLora, proj: str, e: int):
    """Forward hook of local expert ``e``'s linear (megatron-core's loop over experts):
    ``(out, bias)`` -> ``(out + delta, bias)``."""

    def hook(module, args, output):
        if not lora.active(proj):
            return output
        out, bias = output
        return out + lora.delta(proj, e, args[0]).to(out.dtype), bias

    return hook


def _begin(experts, args):
    experts.lora.begin()


def _end(experts, args, output):
    experts.lora.end()


def attach_experts(experts: torch.nn.Module, lora: ExpertLora) -> None:
    """Hang ``lora`` under the experts module; its factors are made ready for each forward."""
    experts.lora = lora
    experts.register_forward_pre_hook(_begin)
    experts.register_forward_hook(_end)
