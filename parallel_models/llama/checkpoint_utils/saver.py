"""Save a TP/PP-sharded model as an HF folder that ``transformers`` loads.

``save_pretrained(model, out_dir)`` is called on every rank. Tensor by tensor, the TP ranks of the
pipeline stage that owns it gather their shards to their first rank, which merges them back to the
HF tensors (its weight rule's ``merge``: q/k/v and gate/up split, replicated KV heads taken
once, vocab padding dropped) and, on a later stage, sends them to global rank 0. A routed expert
of an MoE layer is gathered over the expert-TP ranks of the EP rank that holds it (its first
expert-data-parallel replica) and sent from there. Rank 0 streams
them into size-limited safetensors shards planned up front, so its memory stays at about one
tensor. It writes into a hidden temporary folder next to ``out_dir`` and renames it at the end: an
interrupted save leaves no half folder. Data-parallel replicas other than the first only wait.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from parallel_models.config import resolve_dtype
from parallel_models.llama.checkpoint_utils.collective_save import (all_ok, check_tied_copies,
                                                                   device_of, publish_or_raise,
                                                                   weight_map_of)
from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.hf_format import (ShardedSafetensorsWriter,
                                                             copy_extra_files, write_hf_config)
from parallel_models.llama.checkpoint_utils.output_dir import check_output_dir, temp_dir_for
from parallel_models.llama.checkpoint_utils.weight_map import WeightMap, WeightMapping
from parallel_models.utils.fault_points import fault_point


class _Placement:
    """Which pipeline stage owns each layer / the embedding / the head, and this rank's params."""

    def __init__(self, chunks, config, device):
        L = config.num_layers
        self.L = L
        self.pp = mpu.get_pipeline_model_parallel_world_size()
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        own = torch.full((L + 2,), -1, dtype=torch.int64, device=device)
        self.local: dict[int | str, tuple[object, int | None]] = {}
        for c in chunks:
            for li, layer in enumerate(c.model.layers):
                own[layer.layer_id] = self.pp_rank
                self.local[layer.layer_id] = (c, li)
            if c.pre_process:
                own[L] = self.pp_rank
                self.local["pre"] = (c, None)
            if c.post_process:
                own[L + 1] = self.pp_rank
                self.local["post"] = (c, None)
        if self.pp > 1:
            dist.all_reduce(own, op=dist.ReduceOp.MAX, group=mpu.get_pipeline_model_parallel_group())
        own = own.cpu()
        if (own < 0).any():
            missing = [("embedding" if i == L else "head" if i == L + 1 else f"layer {i}")
                       for i in range(L + 2) if own[i] < 0]
            raise CheckpointError(f"save: no pipeline stage holds {', '.join(missing)}")
        self.owner = own.tolist()
        self.pp_ranks = (dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group())
                         if self.pp > 1 else [0])
        self.ep = mpu.get_expert_model_parallel_world_size()
        self.ep_rank = mpu.get_expert_model_parallel_rank()
        self.expert_src = None  # [stage][EP rank] -> the global rank that sends its experts
        if config.is_moe:
            table = torch.full((self.pp, self.ep), -1, dtype=torch.int64, device=device)
            if (mpu.get_expert_tensor_parallel_rank() == 0
                    and mpu.get_expert_data_parallel_rank() == 0):
                table[self.pp_rank, self.ep_rank] = dist.get_rank()
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
            self.expert_src = table.cpu().tolist()

    def stage_of(self, mapping: WeightMapping, layer: int | None) -> int:
        if layer is not None:
            return self.owner[layer]
        return self.owner[self.L] if mapping.place == "pre" else self.owner[self.L + 1]

    def param(self, mapping: WeightMapping, layer: int | None, config=None) -> torch.Tensor:
        if layer is not None:
            chunk, li = self.local[layer]
            local_expert = (mapping.local_expert(config, self.ep, self.ep_rank)
                            if mapping.expert is not None else None)
            name = mapping.ours_name(li, local_expert)
        else:
            chunk, _ = self.local[mapping.place]
            name = mapping.ours
        params = dict(chunk.named_parameters())
        if name not in params:
            raise CheckpointError(f"internal: weight map names {name!r}, which the model lacks")
        return params[name]


StagePlacement = _Placement  # public name: the hybrid engine's weight sync plans with it


def save_pretrained(model, out_dir: str, *, max_shard_size: int | str = "5GB", dtype=None,
                    source_dir: str | None = None, overwrite: bool = False,
                    progress: bool = False, weight_map: WeightMap | None = None) -> dict:
    """Gather a TP/PP-sharded CausalLM or Value model into an HF folder at ``out_dir``.

    Call on every rank (``model``: this rank's model, or its list of virtual-pipeline chunks).
    Value models are written as ``*ForSequenceClassification`` (``num_labels=1``). ``dtype``
    casts the weights (default: as in the model). Tokenizer and generation-config files are
    copied from ``source_dir`` (default: the folder the model was loaded from). Returns, on every
    rank, ``{"path", "tensors", "bytes", "seconds"}`` (the counts are rank 0's). ``weight_map``:
    default the model's. With tied embeddings at PP > 1 the last stage's copy of the embedding
    must equal the first stage's (only that one is written): checked first, every rank raises.
    """
    chunks: Sequence = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("save_pretrained: no model given")
    first = chunks[0]
    config = first.config
    head_kind = first.head_kind
    if config.hf_config is None:
        raise CheckpointError("save_pretrained: the model's config carries no HF config to write")
    weight_map = weight_map_of(chunks, weight_map)
    device = device_of(chunks)
    rank = dist.get_rank()
    out_dtype = resolve_dtype(dtype, first.dtype)
    source_dir = source_dir if source_dir is not None else getattr(first, "name_or_path", None)
    start = time.perf_counter()

    # 1. can rank 0 write there? (checked before any work; every rank learns the answer)
    error = None
    if rank == 0:
        try:
            check_output_dir(out_dir, overwrite)
        except CheckpointError as err:
            error = err
    if not all_ok(error is None, device):
        raise error if error is not None else CheckpointError(
            f"save_pretrained: rank 0 cannot write {out_dir} (see rank 0's error)")
    check_tied_copies(chunks, config, device, "save_pretrained")

    placement = _Placement(chunks, config, device)
    jobs = weight_map.global_jobs(config, head_kind)
    tp = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    tp_group = mpu.get_tensor_model_parallel_group()
    active = mpu.get_data_parallel_rank() == 0  # other DP replicas hold the same weights
    expert_active = mpu.get_expert_data_parallel_rank() == 0
    etp = mpu.get_expert_tensor_parallel_world_size()
    etp_rank = mpu.get_expert_tensor_parallel_rank()
    etp_group = mpu.get_expert_tensor_parallel_group(check_initialized=False)

    writer = None
    tmp = None
    if rank == 0:
        tmp = temp_dir_for(out_dir)
        specs = [(name, shape, out_dtype) for mapping, layer in jobs
                 for name, shape in zip(mapping.hf_names(layer), mapping.rule.hf_shapes(config))]
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        os.makedirs(tmp)
        writer = ShardedSafetensorsWriter(tmp, specs, max_shard_size)
    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc=f"save {os.path.basename(out_dir)}", unit="tensor")

    failure: BaseException | None = None  # rank 0 keeps receiving after a write error: no hang
    try:
        for mapping, layer in jobs:
            rule = mapping.rule
            names = mapping.hf_names(layer)
            stage = placement.stage_of(mapping, layer)
            tensors = None
            if mapping.expert is None:
                holds = active and placement.pp_rank == stage
                src = placement.pp_ranks[stage]
                n, gathers, group = tp, tp_rank == 0, tp_group
            else:  # a routed expert: on one EP rank, split over the expert-TP group
                owner = mapping.expert_owner(config, placement.ep)
                holds = expert_active and placement.pp_rank == stage and placement.ep_rank == owner
                src = placement.expert_src[stage][owner]
                n, gathers, group = etp, etp_rank == 0, etp_group
            if holds:
                shard = placement.param(mapping, layer, config).detach().contiguous()
                if not rule.split_over_tp or n == 1:
                    if gathers:
                        tensors = rule.merge([shard], config)
                else:
                    bufs = [torch.empty_like(shard) for _ in range(n)] if gathers else None
                    dist.gather(shard, gather_list=bufs,
                                dst=dist.get_global_rank(group, 0), group=group)
                    if gathers:
                        tensors = rule.merge(bufs, config)
                        del bufs
                if tensors is not None and src != 0:  # not on global rank 0: send it there
                    for t in tensors:
                        dist.send(t.contiguous(), dst=0)
            if rank == 0:
                if src != 0:
                    tensors = []
                    for shape in rule.hf_shapes(config):
                        buf = torch.empty(shape, dtype=first.dtype, device=device)
                        dist.recv(buf, src=src)
                        tensors.append(buf)
                if failure is None:
                    try:
                        for name, t in zip(names, tensors):
                            writer.write(name, t.to(out_dtype))
                    except BaseException as err:  # noqa: BLE001 - re-raised below
                        failure = err
                if bar is not None:
                    bar.update(1)
            del tensors
        if rank == 0 and failure is None:
            try:
                writer.close()
                write_hf_config(tmp, config.hf_config,
                                architecture=weight_map.architecture(head_kind),
                                head_kind=head_kind, dtype=out_dtype)
                copy_extra_files(source_dir, tmp)
            except BaseException as err:  # noqa: BLE001
                failure = err
    except BaseException as err:  # noqa: BLE001
        failure = failure or err
    finally:
        if bar is not None:
            bar.close()
    fault_point("hf_save:before_publish")
    publish_or_raise(tmp, out_dir, overwrite, failure, device, rank, "save_pretrained",
                     cleanup=writer.abort if writer is not None else None)
    nbytes = writer.bytes_written if writer is not None else 0
    return {"path": out_dir, "tensors": len(writer.specs) if writer is not None else 0,
            "bytes": nbytes, "seconds": time.perf_counter() - start}
