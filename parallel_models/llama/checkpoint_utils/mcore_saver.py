"""save_mcore: a TP/PP-sharded model of ours -> a megatron-core ``GPTModel`` dist checkpoint,
every rank writing its own shards with megatron-core's ``dist_checkpointing.save``.

Every rank declares its shards as megatron ``ShardedTensor`` s in the layout ``GPTModel``
declares (the weight rules' ``mcore_pieces``); megatron-core's planner and writer do the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch

from parallel_models.config import ConfigError
from parallel_models.llama.checkpoint_utils.collective_save import (all_ok, check_tied_copies,
                                                                   device_of, publish_or_raise,
                                                                   weight_map_of)
from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.hf_format import copy_extra_files, write_hf_config
from parallel_models.llama.checkpoint_utils.megatron_format import (MCORE_CONFIG_FILE,
                                                                   extra_state_objects,
                                                                   mcore_config_dict)
from parallel_models.llama.checkpoint_utils.megatron_layout import (DEFAULT_FORMAT, check_format,
                                                                    common_state,
                                                                    tokenizer_source, weights_dir,
                                                                    write_layout_files)
from parallel_models.llama.checkpoint_utils.output_dir import check_output_dir, temp_dir_for
from parallel_models.llama.checkpoint_utils.weight_map import WeightMap


def sync_save_strategy():
    """megatron-core's torch_dist save, written synchronously by torch DCP's plain writer.

    megatron-core's default strategy forks writer processes (not allowed in daemon processes,
    e.g. multiprocessing workers); this one differs only in who writes the files: the state dict
    translation, the planner and hence the format are megatron-core's own."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = mcore_to_pyt_state_dict(sd, False)
            dcp.save(pyt_state_dict,
                     storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1,
                                                     overwrite=True),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False,
                                              flatten_state_dict=False))

    return SyncTorchDistSave("torch_dist", 1)


def model_sharded_state_dict(model, weight_map: WeightMap, layer_spec: str = "te") -> dict:
    """This rank's weights as megatron-core ``ShardedTensor`` s / ``ShardedObject`` s under the keys
    and layout ``GPTModel.sharded_state_dict()`` uses (``model``: a model or its VPP chunks)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    config = chunks[0].config
    head_kind = chunks[0].head_kind
    tp = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    ep = mpu.get_expert_model_parallel_world_size()
    ep_rank = mpu.get_expert_model_parallel_rank()
    out: dict = {}

    def add(mapping, tensor, layer):
        key, lead, lead_size = mapping.mcore_location(config, layer, layer_spec)
        n, rank, dp = tp, tp_rank, dp_rank
        if mapping.expert is not None:  # routed experts: expert TP, replicas over expert DP
            n = mpu.get_expert_tensor_parallel_world_size()
            rank = mpu.get_expert_tensor_parallel_rank()
            dp = mpu.get_expert_data_parallel_rank()
        for k, piece in enumerate(mapping.rule.mcore_pieces(tensor, config, n, rank)):
            offsets = []
            if lead is not None:
                offsets.append((0, lead, lead_size))
            if piece.axis is not None:
                offsets.append((piece.axis + (1 if lead is not None else 0), piece.index,
                                piece.count))
            # dict keys must be unique on this rank: VPP chunks reuse local layer names
            out[f"{key}#{layer}#{lead}#{k}"] = ShardedTensor.from_rank_offsets(
                key, piece.tensor, *offsets, replica_id=(0, piece.replica, dp),
                prepend_axis_num=1 if lead is not None else 0)

    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for mapping in weight_map.mappings(config, head_kind, pre_process=chunk.pre_process,
                                           post_process=chunk.post_process):
            if mapping.tied_copy:
                continue  # a tied last stage's copy of the embedding: saved by the first stage
            if mapping.per_layer:
                local_expert = None
                if mapping.expert is not None:
                    local_expert = mapping.local_expert(config, ep, ep_rank)
                    if local_expert is None:
                        continue  # another EP rank's expert
                for li, layer in enumerate(chunk.model.layers):
                    if mapping.applies_to(config, layer.layer_id):
                        add(mapping, params[mapping.ours_name(li, local_expert)].detach(),
                            layer.layer_id)
            else:
                add(mapping, params[mapping.ours].detach(), None)
        per = config.num_experts // ep if config.is_moe else 0
        for li, layer in enumerate(chunk.model.layers):
            for key, index, count in extra_state_objects(config, layer.layer_id):
                expert = ".experts.experts." in key
                if expert and not ep_rank * per <= index < (ep_rank + 1) * per:
                    continue
                replica = ((0, mpu.get_expert_tensor_parallel_rank(),
                            mpu.get_expert_data_parallel_rank()) if expert
                           else (0, tp_rank, dp_rank))
                out[f"{key}#{index}"] = ShardedObject(key, None, (count,), (index,),
                                                      replica_id=replica)
    return out


def save_mcore(model, out_dir: str, *, layer_spec: str = "te", overwrite: bool = False,
               source_dir: str | None = None, weight_map: WeightMap | None = None,
               format: str = DEFAULT_FORMAT) -> dict:
    """Save a TP/PP-sharded model of ours as a megatron-core ``GPTModel`` dist checkpoint that
    megatron-core (and ``from_pretrained``) loads at any TP/PP, plus ``config.json``,
    ``mcore_config.json`` and the tokenizer files. Call on every rank; written into a temporary
    folder and renamed at the end (all or nothing). ``weight_map``: default the model's.
    ``format``: the folder layout, as ``hf2mcore --format`` (``megatron_layout``; default one
    Megatron-LM and Megatron-Bridge both load)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from parallel_models import cpu_shim

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    first = chunks[0]
    config = first.config
    weight_map = weight_map_of(chunks, weight_map)
    device = device_of(chunks)
    rank = dist.get_rank()
    start = time.perf_counter()
    error = None
    info = None
    tokenizer = tokenizer_source(source_dir if source_dir is not None
                                 else getattr(first, "name_or_path", None))
    try:  # every rank: the common state of the iteration layouts is part of what each saves
        check_format(format)
        info = mcore_config_dict(config, head_kind=first.head_kind, dtype=first.dtype,
                                 layer_spec=layer_spec)
        if rank == 0:
            check_output_dir(out_dir, overwrite)
    except (CheckpointError, ConfigError) as err:
        error = err
    if not all_ok(error is None, device):
        raise error if error is not None else CheckpointError(
            f"save_mcore: rank 0 cannot write {out_dir} (see rank 0's error)")
    check_tied_copies(chunks, config, device, "save_mcore")
    # one temporary folder name for all ranks
    tag = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
    dist.broadcast(tag, src=0)
    root = temp_dir_for(out_dir, f"{int(tag.item()):x}")
    tmp = weights_dir(root, format)
    if rank == 0:
        os.makedirs(tmp)
    dist.barrier()
    failure = None
    try:
        sharded = model_sharded_state_dict(chunks, weight_map, layer_spec)
        # megatron-core checks the sharding on rank 0 only and raises there, which would leave
        # the other ranks waiting in the save: check first and let every rank know
        from megatron.core.dist_checkpointing.validation import (determine_global_metadata,
                                                                 validate_sharding_integrity)

        validate_sharding_integrity(determine_global_metadata(sharded)[1])
        sharded.update(common_state(info, format, tokenizer))  # -> common.pt (rank 0 writes it)
    except BaseException as err:  # noqa: BLE001
        failure = err
    if not all_ok(failure is None, device):
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        raise failure or CheckpointError("save_mcore: invalid sharding (see rank 0's error)")
    try:
        with cpu_shim.cuda_to_cpu():
            dist_checkpointing.save(sharded, tmp, sharded_strategy=sync_save_strategy(),
                                    validate_access_integrity=False)
    except BaseException as err:  # noqa: BLE001
        failure = err
    if rank == 0 and failure is None:
        try:  # ours (HF config, megatron arguments, tokenizer) in the output folder itself
            write_hf_config(root, config.hf_config,
                            architecture=weight_map.architecture(first.head_kind),
                            head_kind=first.head_kind, dtype=first.dtype)
            with open(os.path.join(root, MCORE_CONFIG_FILE), "w") as f:
                json.dump(info, f, indent=2)
            copy_extra_files(source_dir if source_dir is not None
                             else getattr(first, "name_or_path", None), root)
            write_layout_files(root, format, info, tokenizer)
        except BaseException as err:  # noqa: BLE001
            failure = err
    publish_or_raise(root, out_dir, overwrite, failure, device, rank, "save_mcore")
    return {"path": out_dir, "seconds": time.perf_counter() - start}
