"""What both collective savers (``saver.save_pretrained``, ``mcore_saver.save_mcore``) share: every
rank agreeing on success or failure, the all-or-nothing publication of the output folder, and the
check that a tied last stage's copy of the embedding still equals the first stage's."""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from parallel_models.llama.checkpoint_utils.errors import CheckpointError
from parallel_models.llama.checkpoint_utils.output_dir import publish_dir


def device_of(chunks) -> torch.device:
    """Where the weights of the model chunks live (the device collectives use)."""
    for c in chunks:
        for p in c.parameters():
            return p.device
    return torch.device("cpu")


def weight_map_of(chunks, weight_map=None):
    """``weight_map`` if given, else the one the model carries (the registry's classes set it)."""
    found = weight_map if weight_map is not None else getattr(chunks[0], "weight_map", None)
    if found is None:
        raise CheckpointError(f"{type(chunks[0]).__name__} carries no weight map; build the model "
                              "through parallel_models' named classes (e.g. LlamaForCausalLM) "
                              "or pass weight_map=")
    return found


def all_ok(ok: bool, device) -> bool:
    """True on every rank when ``ok`` on every rank (one all-reduce)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def publish_or_raise(tmp: str, out_dir: str, overwrite: bool, failure, device, rank: int,
                     what: str, cleanup=None) -> None:
    """End of a collective save: if every rank succeeded, rank 0 renames ``tmp`` to ``out_dir``;
    otherwise (or if that fails) ``tmp`` is removed and every rank raises."""
    ok = all_ok(failure is None, device)
    if rank == 0:
        if ok:
            try:
                publish_dir(tmp, out_dir, overwrite)
            except BaseException as err:  # noqa: BLE001
                failure = err
        if not ok or failure is not None:
            if cleanup is not None:
                cleanup()
            shutil.rmtree(tmp, ignore_errors=True)
    published = all_ok(failure is None, device)
    if failure is not None:
        raise failure
    if not published:
        raise CheckpointError(f"{what}: saving {out_dir} failed on another rank; nothing was written")


def _checksum(t: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """A cheap fingerprint of a tensor's values: float64 sum and sum of squares, over blocks of
    ``rows`` rows (the float64 copy stays at one block, not the whole embedding)."""
    out = torch.zeros(2, dtype=torch.float64, device=t.device)
    for block in t.detach().split(rows):
        x = block.double()
        out[0] += x.sum()
        out[1] += x.square().sum()
    return out


def check_tied_copies(chunks, config, device, what: str) -> None:
    """With tied embeddings at PP > 1 the last stage holds its own copy of the embedding as its
    head, and a save writes only the first stage's. Compare the two (per TP rank: a float64
    sum and sum of squares of each shard, exchanged over the pipeline group) and raise on every
    rank, naming the stages, if they differ. A no-op without tied embeddings or at PP = 1."""
    pp = mpu.get_pipeline_model_parallel_world_size()
    if not config.tie_word_embeddings or pp == 1:
        return
    first, last = None, None
    for c in chunks:
        if getattr(c, "head_kind", None) != "causal_lm":
            return  # value models have no LM head to tie
        if c.pre_process:
            first = c.model.embed_tokens.weight
        if c.post_process:
            last = c.output_weight()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    if first is not None:
        sums[:2] = _checksum(first)
    if last is not None:
        sums[2:] = _checksum(last)
    dist.all_reduce(sums, group=mpu.get_pipeline_model_parallel_group())
    equal = bool(torch.equal(sums[:2], sums[2:]))
    if all_ok(equal, device):
        return
    tp_rank = mpu.get_tensor_model_parallel_rank()
    detail = (f" (TP rank {tp_rank}: stage 0 sum {sums[0].item():.9g}, sum of squares "
              f"{sums[1].item():.9g}; stage {pp - 1} sum {sums[2].item():.9g}, sum of squares "
              f"{sums[3].item():.9g})" if not equal else "")
    raise CheckpointError(
        f"{what}: tied embeddings differ between pipeline stage 0 (the embedding) and stage "
        f"{pp - 1} (its copy as the LM head){detail}; only stage 0's would be written. Keep "
        "them in sync (the tied-embedding gradient all-reduce) before saving.")
