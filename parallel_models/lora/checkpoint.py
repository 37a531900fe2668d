"""The adapters of a LoRA model in trainer checkpoints (megatron-core ``dist_checkpointing``):
with LoRA a checkpoint holds the adapters (and their optimizer states) only; the base weights
come from ``model.path`` again on resume.

Each adapter matrix is declared at its full (PEFT) size under its PEFT name, the TP slice this
rank holds as one chunk of it (column layers' B: rows; row layers' A: columns; the replicated
halves as TP replicas), so a checkpoint saved at one TP/PP layout loads at another, as the base
model's do (``rl/roles/sharded_state.py``). An MoE layer's expert adapters are declared in our
per-expert layout (``[experts, r, in]`` / ``[experts, out, r]``, ``lora/experts.py``), this rank's
experts one chunk along the first axis, its ETP slice another (fused gate-up rows as
``[experts, 2, I, r]``), replicas over the expert-data-parallel group. A ``ShardedTensorFactory``
holding the parameter
itself: megatron's optimizer finds the parameter's states by identity and declares Adam's
moments with the same factory.
"""

from __future__ import annotations

from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from parallel_models.lora.apply import lora_modules
from parallel_models.lora.experts import ExpertLora
from parallel_models.lora.peft_io import _split_dims, _tp_rank, adapter_name, peft_name


def _factory(key: str, param, axis: int | None, tp_rank: int, tp: int, replica: tuple,
             clone: bool) -> ShardedTensorFactory:
    def build(key, data, replica_id, *unused):
        src = data.detach().clone() if clone else data.detach()
        offsets = [(axis, tp_rank, tp)] if axis is not None and tp > 1 else []
        return {0: ShardedTensor.from_rank_offsets(key, src.contiguous(), *offsets,
                                                   replica_id=replica_id)}

    def merge(loaded: dict):
        return loaded[0]

    return ShardedTensorFactory(key=key, data=param, build_fn=build, merge_fn=merge,
                                replica_id=replica)


def _expert_factory(key: str, param, lora: ExpertLora, proj: str, which: str,
                    clone: bool) -> ShardedTensorFactory:
    """The factory of one expert adapter matrix (see the module doc)."""
    shape = tuple(param.shape)
    fused = (proj, which) == ("gate_up_proj", "B")
    split = {("gate_up_proj", "B"): 2, ("down_proj", "A"): 2}.get((proj, which))
    dp_rank = mpu.get_expert_data_parallel_rank()
    replica = (0, 0 if split is not None else lora.tp_rank, dp_rank)

    def build(key, data, replica_id, *unused):
        src = data.detach().clone() if clone else data.detach()
        src = src.reshape(shape[0], 2, shape[1] // 2, shape[2]) if fused else src
        offsets = [(0, lora.ep_rank, lora.ep)]
        if split is not None and lora.tp > 1:
            offsets.append((split, lora.tp_rank, lora.tp))
        return {0: ShardedTensor.from_rank_offsets(key, src.contiguous(), *offsets,
                                                   replica_id=replica_id)}

    def merge(loaded: dict):
        return loaded[0].reshape(shape)

    return ShardedTensorFactory(key=key, data=param, build_fn=build, merge_fn=merge,
                                replica_id=replica)


def adapter_sharded_state_dict(chunk, index: int, prefix: str, *, clone: bool = False) -> dict:
    """``{"<index>.<our parameter name>": factory}`` of the adapters of one model chunk."""
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    names = {id(p): n for n, p in chunk.named_parameters()}
    out = {}
    for layer_id, where, lora in lora_modules(chunk):
        if isinstance(lora, ExpertLora):
            for proj, ad in lora.adapters.items():
                for which, lin in (("A", ad.lora_A), ("B", ad.lora_B)):
                    key = f"{prefix}.lora.{adapter_name(layer_id, where, lora, proj, which)}"
                    out[f"{index}.{names[id(lin.weight)]}"] = _expert_factory(
                        key, lin.weight, lora, proj, which, clone)
            continue
        dims = _split_dims(lora)
        tp_rank = _tp_rank(lora)
        for proj, ad in lora.adapters.items():
            for which, lin, axis in (("A", ad.lora_A, dims[0]), ("B", ad.lora_B, dims[1])):
                param = lin.weight
                replica = (0, 0 if axis is not None else tp_rank, dp_rank)
                key = f"{prefix}.lora.{peft_name(layer_id, where, proj, which)}"
                out[f"{index}.{names[id(param)]}"] = _factory(key, param, axis, tp_rank,
                                                              lora.tp, replica, clone)
    return out
