"""Sharded state of a trainable model of ours for megatron-core ``dist_checkpointing``: its weights
and its megatron optimizer's states, declared so that a checkpoint saved at one TP/PP/DP layout
loads at another.

Our model classes are not megatron's ``GPTModel``, so their ``sharded_state_dict()`` is built here
from the one weight map (``checkpoint_utils.weight_map``): every parameter becomes a megatron
``ShardedTensorFactory`` whose pieces are ``ShardedTensor`` s of the megatron-core ``GPTModel``
global tensor (``mcore_pieces``: the TP axis and block of each piece, fused QKV grouped per KV
head, ``[gate; up]``), stacked over the *global* layer index (so PP stage offsets do not matter),
with replica ids ``(tied copy, TP replica, DP rank)``. MoE models follow the MoE weight map
(``checkpoint_utils.moe_weight_map``): megatron-core's per-layer keys (``decoder.layers.{i}.``,
``WeightMapping.mcore_location``), the dense- or MoE-only mappings on their layers only
(``applies_to``), and each routed expert as one slice of a leading expert axis, held by the EP rank
that owns it and replicated over the expert-data-parallel group, so a checkpoint saved at one
expert-parallel size loads at another. A factory, not a plain tensor, because the
fused QKV / gate-up pieces are not views of one block of the global tensor; megatron's optimizer
(``optimizer.sharded_state_dict(model_sharded_state_dict)``) applies the same factory to Adam's
``exp_avg`` / ``exp_avg_sq`` (and the fp32 main params of a bf16 model), so optimizer states
reshard exactly like the weights. Vocab rows are declared up to the true vocab size (our TP
padding rows are not saved), so the global shapes do not depend on TP.

megatron-core's distributed optimizer is declared in its ``fully_reshardable`` format (its flat
DP shards gathered into tensors of each parameter's shape, cut by the same factories), so its
checkpoints load at another TP/PP/DP layout too; three megatron-core 0.16 slips on that path are
worked around here (``_init_distributed_states``, ``_fix_bucket_offsets``, ``_load_distributed``).

``save_roles`` / ``load_roles`` / ``apply_loaded`` write and read the models and optimizers of
several roles (``{name: (chunks, optimizer)}``, keys prefixed by the name) as one dist checkpoint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from parallel_models import cpu_shim
from parallel_models.llama.checkpoint_utils.weight_map import weight_rules
from parallel_models.llama.checkpoint_utils.weight_rules import VocabSplit


def _vocab_piece(key, tensor, config, tp_rank: int, replica_id):
    """Rows of this rank's vocab shard that are real tokens, as a (possibly uneven) chunk of the
    ``[vocab_size, ...]`` global tensor; None when the whole shard is padding."""
    rows = tensor.shape[0]
    start = tp_rank * rows
    real = min(rows, config.vocab_size - start)
    if real <= 0:
        return None
    piece = tensor[:real]
    global_shape = (config.vocab_size, *tensor.shape[1:])
    regular = real == rows and config.vocab_size % rows == 0
    return ShardedTensor(key=key, data=piece, dtype=piece.dtype, local_shape=tuple(piece.shape),
                         global_shape=global_shape, global_offset=(start, *[0] * (piece.dim() - 1)),
                         axis_fragmentations=((config.vocab_size // rows, *[1] * (piece.dim() - 1))
                                              if regular else None),
                         replica_id=replica_id)


def _source_indices(mapping, shape, config, tp: int, tp_rank: int) -> list[torch.Tensor]:
    """For each piece the weight map cuts from a shard of ``shape``: the flat shard index of each
    of its elements (the pieces of an index tensor), which inverts the cut exactly."""
    index = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64).reshape(shape)
    return [p.tensor.reshape(-1) for p in mapping.rule.mcore_pieces(index, config, tp, tp_rank)]


def _factory(key: str, param: torch.Tensor, mapping, name: str, config,
             lead: tuple[int, int] | None, tied_copy: int, clone: bool) -> ShardedTensorFactory:
    """``lead``: (index, size) of the parameter on the global tensor's leading axis (the layer of
    a stacked dense model, the expert of a routed-expert tensor), None without one."""
    tp = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    # routed experts are sharded over EP inside the DP group: replicas over expert-DP only
    dp_rank = (mpu.get_expert_data_parallel_rank() if mapping.expert is not None
               else mpu.get_data_parallel_rank(with_context_parallel=True))
    shape = tuple(param.shape)
    vocab = isinstance(mapping.rule, VocabSplit)  # saved up to the true vocab size
    if "qkv" in name and config.num_key_value_heads < tp:
        raise ValueError(f"{name}: trainer checkpoints need num_key_value_heads "
                         f"({config.num_key_value_heads}) >= tensor_parallel_size ({tp})")

    def build(key, data, replica_id, *unused):
        # fresh copies when loading, so a failed load leaves the model and optimizer untouched
        src = data.detach().clone() if clone else data.detach()
        out = {}
        for i, piece in enumerate(mapping.rule.mcore_pieces(src, config, tp, tp_rank)):
            replica = (tied_copy, piece.replica, dp_rank)
            tensor = piece.tensor.contiguous()
            if vocab:
                sharded = _vocab_piece(key, tensor, config, tp_rank, replica)
                if sharded is not None:
                    out[i] = sharded
                continue
            offsets = [] if lead is None else [(0, *lead)]
            if piece.axis is not None:
                offsets.append((piece.axis + (lead is not None), piece.index, piece.count))
            out[i] = ShardedTensor.from_rank_offsets(
                key, tensor, *offsets, replica_id=replica,
                prepend_axis_num=1 if lead is not None else 0)
        return out

    def merge(loaded: dict) -> torch.Tensor:
        """The inverse of ``build``: put every loaded element back where it came from."""
        first = next(iter(loaded.values()), param)
        out = torch.zeros(shape, dtype=first.dtype, device=first.device)
        flat = out.view(-1)
        sources = _source_indices(mapping, shape, config, tp, tp_rank)
        for i, values in loaded.items():
            src = sources[i][: values.numel()].to(out.device)  # vocab: the real rows only
            flat[src] = values.reshape(-1).to(out.dtype)
        return out

    return ShardedTensorFactory(key=key, data=param, build_fn=build, merge_fn=merge,
                                replica_id=(tied_copy, tp_rank, dp_rank))


def model_sharded_state_dict(chunks, prefix: str, *, clone: bool = False) -> dict:
    """``{"<chunk>.<our parameter name>": factory}`` for this rank's model chunks; the factories
    hold the parameters themselves (megatron's optimizer finds its states by parameter identity).
    ``clone``: the factories build their pieces from copies (for loading)."""
    out: dict = {}
    for c, chunk in enumerate(chunks):
        lora = getattr(getattr(chunk, "module", chunk), "lora_settings", None) is not None
        if lora:
            from parallel_models.lora.checkpoint import adapter_sharded_state_dict

            # LoRA: the adapters and the trainable base weights (a value head) only; the
            # frozen base comes from model.path on resume
            out.update(adapter_sharded_state_dict(getattr(chunk, "module", chunk), c, prefix,
                                                  clone=clone))
        config = chunk.config
        params = dict(chunk.named_parameters())
        mappings = weight_rules(config, chunk.head_kind, pre_process=chunk.pre_process,
                                post_process=chunk.post_process)
        for m in mappings:
            # a tied last stage's copy of the embedding: a non-main replica of the embedding
            tied = int(m.tied_copy)
            for name, (key, lead) in _placements(m, chunk, config):
                if lora and not params[name].requires_grad:
                    continue
                out[f"{c}.{name}"] = _factory(f"{prefix}.{key}", params[name], m, name, config,
                                              lead, tied, clone)
        if lora:
            params = {n: p for n, p in params.items() if p.requires_grad}
        missing = set(params) - {k.split(".", 1)[1] for k in out if k.startswith(f"{c}.")}
        if missing:
            raise ValueError(f"{prefix}: parameters without a weight rule: {sorted(missing)}")
    return out


def _placements(mapping, chunk, config):
    """(our parameter name, (megatron-core key, leading (index, size) or None)) of each tensor
    ``mapping`` has on this rank's ``chunk``: one per local layer it applies to (MoE: dense- and
    MoE-only mappings skip the other layers; a routed expert only on the EP rank holding it)."""
    if not mapping.per_layer:
        return [(mapping.ours, (mapping.mcore, None))]
    local_expert = None
    if mapping.expert is not None:
        local_expert = mapping.local_expert(config, mpu.get_expert_model_parallel_world_size(),
                                            mpu.get_expert_model_parallel_rank())
        if local_expert is None:
            return []
    out = []
    for li, layer in enumerate(chunk.model.layers):
        if not mapping.applies_to(config, layer.layer_id):
            continue
        key, index, size = mapping.mcore_location(config, layer.layer_id)
        out.append((mapping.ours_name(li, local_expert),
                    (key, None if index is None else (index, size))))
    return out


# megatron-core's distributed optimizer in its fully reshardable format: its flat DP shards are
# gathered over DP into tensors of each parameter's shape, which our factories then cut like the
# weights (the default, ``fully_sharded_model_space``, hands the factories flat slices, which
# megatron-core 0.16 no longer supports). Other megatron optimizers ignore the metadata.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _init_distributed_states(optimizer) -> None:
    """Zero states for a distributed optimizer that has not stepped yet (a resume at start-up):
    megatron-core declares its sharded state from its ``state_dict()``, which reads the Adam step
    of every state. Its own ``init_state_fn`` (the moments) plus torch Adam's step counter; the
    hybrid device optimizer (CUDA, ``optimizer_offload_fraction``) initialises through its own
    ``dummy_step`` (random gradients), as megatron-core's ``load_state_dict`` does, here at
    learning rate 0 so the weights do not move (the loaded states replace its moments).
    ``empty_optimizer_states`` lists them first, so a failed load drops them again."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if not isinstance(opt, DistributedOptimizer) or inner.state:
            continue
        if hasattr(inner, "dummy_step"):  # at lr 0 the weights stay as they are
            lrs = [g["lr"] for g in inner.param_groups]
            for g in inner.param_groups:
                g["lr"] = 0.0
            try:
                inner.dummy_step()
            finally:
                for g, lr in zip(inner.param_groups, lrs):
                    g["lr"] = lr
            continue
        opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _unshare_steps(optimizer) -> None:
    """One step tensor per Adam state again: the distributed optimizer's ``load_state_dict``
    gives every state the same tensor, which torch's Adam then increments in place once per
    parameter (a resumed run would step its bias correction too fast)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _fix_bucket_offsets(optimizer, optimizer_sd: dict) -> None:
    """Point each saved distributed-optimizer state at the right elements. megatron-core 0.16's
    fully reshardable save gathers a buffer's buckets into one tensor without the padding
    between buckets, then slices each parameter out of it at its offset in the buffer, which
    still counts that padding (its own warning cites issue #504): a parameter in a later bucket
    (a tied embedding gets a bucket of its own) is saved shifted by the padding before it, and
    zero-padded at the end. Such parameters are cut again from the same gathered tensors."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [optimizer_sd] if len(opts) == 1 else [optimizer_sd[k] for k in sorted(optimizer_sd)]
    for opt, opt_sd in zip(opts, states):
        if not isinstance(opt, DistributedOptimizer) or not opt_sd.get("param_state"):
            continue
        shifts = []  # per buffer, per bucket: the padding dropped before it
        for buffer in opt.buffers:
            shifts.append([0])
            for bucket in buffer.buckets[:-1]:
                shifts[-1].append(shifts[-1][-1] + bucket.grad_data.numel()
                                  - bucket.numel_unpadded)
        if not any(any(s) for s in shifts):
            continue
        with cpu_shim.cuda_to_cpu():  # the same gather megatron-core made
            world = opt.get_parameter_state_dp_zero(use_gloo_comm=False,
                                                    return_on_all_ranks=True)
        index = 0
        for gbuf_idx, buffer in enumerate(opt.buffers):
            (tensors,) = world[gbuf_idx].values()  # one dtype per buffer (megatron asserts it)
            for start, end, bucket_id in buffer.param_index_map.values():
                at = start - shifts[gbuf_idx][bucket_id]
                for key, value in opt_sd["param_state"][index].items():
                    if shifts[gbuf_idx][bucket_id]:
                        value.data = tensors[key][at:at + end - start].reshape(value.data.shape)
                index += 1


def roles_sharded_state_dict(roles: dict, *, loading: bool = False) -> dict:
    """The models and megatron optimizer states of ``roles`` (``{name: (chunks, optimizer)}``)."""
    out = {}
    for name, (chunks, optimizer) in roles.items():
        model_sd = model_sharded_state_dict(chunks, name, clone=loading)
        if loading:
            _init_distributed_states(optimizer)
        with cpu_shim.cuda_to_cpu():  # the distributed optimizer's gather over DP
            optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                                        metadata=dict(OPTIMIZER_METADATA))
        if loading:  # (its declaration reloads its own state dict: one shared step tensor)
            _unshare_steps(optimizer)
        else:
            _fix_bucket_offsets(optimizer, optimizer_sd)
        out[name] = {"model": model_sd, "optimizer": optimizer_sd}
    return out


def all_ranks_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64,
                        device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def save_roles(folder: str, roles: dict) -> None:
    """Save ``roles`` into the existing empty ``folder`` (every rank; collective). The sharding is
    checked on every rank first (megatron checks it on rank 0 only and raises there)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base
    from megatron.core.dist_checkpointing.validation import (determine_global_metadata,
                                                             validate_sharding_integrity)

    from parallel_models.llama.checkpoint_utils.mcore_saver import sync_save_strategy

    failure = None
    try:
        sharded = roles_sharded_state_dict(roles)
        check = roles_sharded_state_dict(roles)  # megatron applies the factories in place
        apply_factories(check)
        _, check = extract_nonpersistent(check)
        validate_sharding_integrity(determine_global_metadata(extract_sharded_base(check)[0])[1])
    except Exception as err:  # noqa: BLE001
        failure = err
    if not all_ranks_ok(failure is None):
        raise failure or RuntimeError(f"{folder}: invalid sharding (see rank 0's error)")
    with cpu_shim.cuda_to_cpu():
        dist_checkpointing.save(sharded, folder, sharded_strategy=sync_save_strategy(),
                                validate_access_integrity=False)


def empty_optimizer_states(roles: dict) -> list:
    """(torch optimizer, param) pairs without state yet: declaring the optimizer state for loading
    creates zero states there (megatron's ``init_state_fn``), which a failed load must undo."""
    out = []
    for _, optimizer in roles.values():
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = opt.optimizer
            out += [(inner, p) for g in inner.param_groups for p in g["params"]
                    if not inner.state.get(p)]
    return out


def load_roles(folder: str, sharded: dict) -> dict:
    """Read ``sharded`` (``roles_sharded_state_dict(roles, loading=True)``) from ``folder`` into
    fresh tensors; the roles themselves are not touched (see ``apply_loaded``)."""
    from megatron.core import dist_checkpointing

    with cpu_shim.cuda_to_cpu():
        return dist_checkpointing.load(sharded, folder)


def apply_loaded(roles: dict, loaded: dict) -> None:
    """Copy loaded weights into the models and loaded states into the optimizers."""
    for name, (chunks, optimizer) in roles.items():
        load_model_weights(chunks, loaded[name]["model"])
        load_optimizer_state(optimizer, loaded[name]["optimizer"])


def load_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, with megatron-core's distributed optimizer loaded in
    its two halves (:func:`_load_distributed`)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if not any(isinstance(o, DistributedOptimizer) for o in opts):
        optimizer.load_state_dict(state)
        return
    # a chain of one is saved as its optimizer's dict, a longer one as {index: dict}
    states = [state] if len(opts) == 1 else [state[k] for k in sorted(state)]
    for opt, opt_state in zip(opts, states, strict=True):
        if isinstance(opt, DistributedOptimizer):
            _load_distributed(opt, opt_state)
        else:
            opt.load_state_dict(opt_state)
    if len(opts) > 1:
        optimizer._synchronize_steps()


def _load_distributed(opt, state: dict) -> None:
    """The distributed optimizer's ``load_state_dict`` split in two: the param groups (and torch
    Adam's per-state ``step``, which megatron-core sets from them), then the per-parameter states
    of the fully reshardable format. megatron-core's own path copies every key of each state,
    ``step`` included, from the loaded tensors, which carry no step (its fused optimizers keep
    none): a KeyError with torch's Adam. So the steps step aside while the tensors load (the
    hybrid device optimizer's sub-optimizers share these state dicts), and come back as one
    tensor per state (:func:`_unshare_steps`)."""
    state = dict(state)
    param_state = state.pop("param_state")
    kind = state.pop("param_state_sharding_type")
    if kind != OPTIMIZER_METADATA["distrib_optim_sharding_type"]:
        raise ValueError(f"distributed optimizer state of type {kind!r}, expected "
                         f"{OPTIMIZER_METADATA['distrib_optim_sharding_type']!r}")
    with cpu_shim.cuda_to_cpu():
        opt.load_state_dict(state)
        held = {id(s): (s, s.pop("step")) for s in opt.optimizer.state.values() if "step" in s}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for s, step in held.values():
                s["step"] = step
    _unshare_steps(opt)


def global_shapes(sharded: dict) -> dict[str, tuple[int, ...]]:
    """``{key: global shape}`` of every ShardedTensor the factories of ``sharded`` declare."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    out: dict[str, tuple[int, ...]] = {}

    def visit(value):
        if isinstance(value, ShardedTensorFactory):
            for v in nested_values(value.build()):
                visit(v)
        elif isinstance(value, ShardedTensor):
            out[value.key] = tuple(value.global_shape)

    for v in nested_values(sharded):
        visit(v)
    return out


def load_model_weights(chunks, loaded: dict) -> None:
    """Copy weights returned by ``dist_checkpointing.load`` (merged factories) into the params."""
    for c, chunk in enumerate(chunks):
        params = dict(chunk.named_parameters())
        with torch.no_grad():
            for name, param in params.items():
                if f"{c}.{name}" not in loaded and not param.requires_grad:
                    continue  # LoRA's frozen base: not in the checkpoint
                value = loaded[f"{c}.{name}"]
                param.copy_(value.to(device=param.device, dtype=param.dtype))
