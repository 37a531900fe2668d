"""Trainer side of ``rollout.backend: server``: rollouts from the server in the trainer's batch
format, and weight pushes after each update.

``server_rollout`` returns the same dict as ``PPOTrainer._rollout`` (``sequences`` = left-padded
prompts + right-padded responses, ``attention_mask``, ``prompt_lengths``, ``response_mask``,
``group_index``) plus the server's ``rollout_log_probs``, ``weight_version`` and, when asked
(MoE), ``routes``. Only the first rank of each model-parallel group (TP x PP: one training DP replica) talks to
the server; the batch is broadcast to the group's other ranks.

``push_actor_weights`` streams the actor to the server (``weight_stream.py``, no folder on disk),
broadcasts it over a process group with the server (``weight_group_push.py``) or, as the
fallback or on request, saves an HF folder the server loads (``push_weights``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _replica_info():
    """(size, rank in it, its first global rank, group) of this rank's model-parallel group (the
    TP x PP ranks of one training DP replica, which share its prompts): only its first rank asks
    the server, so a PP > 1 trainer does not generate each replica's rollout once per stage."""
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:
        return 1, 0, 0, None
    if not mpu.model_parallel_is_initialized():
        return 1, 0, 0, None
    group = mpu.get_model_parallel_group()
    size = dist.get_world_size(group)
    return size, dist.get_rank(group), dist.get_global_rank(group, 0), group


def _request(client, prompt_ids, params, seed: int | None, eos_token_id, routes: bool) -> dict:
    # the trainer's EOS travels as stop ids (the server's tokenizer may differ)
    wire = params.model_copy(update=dict(
        stop_token_ids=params.stop_ids(eos_token_id), eos_token_id=None, ignore_eos=True,
        seed=None if params.greedy else seed))
    return client.generate([list(map(int, p)) for p in prompt_ids], wire, return_text=False,
                           return_routes=routes)


def _routes_tensor(prompts, samples, p_max: int, r_max: int, num_experts: int | None):
    """The samples' ``routes`` lists as ``[rows, P + R, layers, k]`` (compact), aligned with
    the batch's left-padded prompts and right-padded responses."""
    from parallel_models.utils import routes as route_utils

    first = torch.tensor(samples[0]["routes"])
    full = torch.full((len(samples), p_max + r_max, *first.shape[1:]), route_utils.MISSING,
                      dtype=torch.long)
    for b, (p, s) in enumerate(zip(prompts, samples)):
        r = torch.tensor(s["routes"], dtype=torch.long)
        full[b, p_max - len(p):p_max - len(p) + r.shape[0]] = r
    experts = num_experts if num_experts is not None else int(full.max()) + 1
    return route_utils.compact(full, experts)


def batch_from_response(resp: dict, n: int, pad_token_id: int = 0,
                        num_experts: int | None = None) -> dict:
    """The trainer's rollout dict from a /generate answer (rows: prompt-major, n per prompt)."""
    prompts, samples = [], []
    for r in resp["results"]:
        for s in r["samples"]:
            prompts.append(r["prompt_token_ids"])
            samples.append(s)
    rows = len(prompts)
    p_max = max(len(p) for p in prompts)
    r_max = max(max(len(s["token_ids"]) for s in samples), 1)
    seq = torch.full((rows, p_max + r_max), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, p_max + r_max), dtype=torch.long)
    logp = torch.zeros((rows, r_max), dtype=torch.float32)
    for b, (p, s) in enumerate(zip(prompts, samples)):
        seq[b, p_max - len(p):p_max] = torch.tensor(p)
        mask[b, p_max - len(p):p_max] = 1
        k = len(s["token_ids"])
        if k:
            seq[b, p_max:p_max + k] = torch.tensor(s["token_ids"])
            mask[b, p_max:p_max + k] = 1
            logp[b, :k] = torch.tensor(s["log_probs"])
    out = {"sequences": seq, "attention_mask": mask,
           "prompt_lengths": mask[:, :p_max].sum(-1), "response_mask": mask[:, p_max:].clone(),
           "group_index": torch.arange(len(resp["results"])).repeat_interleave(n),
           "rollout_log_probs": logp, "weight_version": resp["weight_version"]}
    if samples and "routes" in samples[0]:
        out["routes"] = _routes_tensor(prompts, samples, p_max, r_max, num_experts)
    return out


def server_rollout(client, prompt_ids, params, seed: int | None = None, device=None, *,
                   eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
                   num_experts: int | None = None) -> dict:
    """Generate ``params.n`` samples of each prompt on the server with ``params`` (a
    SamplingParams; its EOS, else ``eos_token_id``, and its stop ids are sent as
    ``stop_token_ids``); ``pad_token_id`` pads the batch. ``num_experts`` (an MoE actor): the
    server also returns the routes (``routes``, compact for that many experts)."""
    size, rank, src, group = _replica_info()
    batch = None
    if rank == 0:
        resp = _request(client, prompt_ids, params, seed, eos_token_id, num_experts is not None)
        batch = batch_from_response(resp, params.n, pad_token_id, num_experts)
    if size > 1:
        obj = [batch]
        dist.broadcast_object_list(obj, src=src, group=group)
        batch = obj[0]
    if device is not None:
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    return batch


def push_weights(model, client, folder: str) -> int | None:
    """Save ``model`` as an HF folder (every rank calls; rank 0 writes) and have the server load
    it. Returns the server's new weight version on global rank 0 (None elsewhere). The folder
    must be readable by the server (same machine or a shared file system)."""
    import torch.distributed as dist

    model.save_pretrained(folder, overwrite=True)  # the server reads it only during the update
    version = None
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        version = client.update_weights(os.path.abspath(folder))["weight_version"]
    if dist.is_initialized():
        dist.barrier()
    return version


def push_actor_weights(model, client, folder: str, mode: str = "stream") -> int | None:
    """Every rank calls. ``mode="stream"``: stream the weights to the server; ``"group"``:
    broadcast them over a process group with the server (``weight_group_push.py``); if either
    fails (server gone, push rejected), warn and fall back to the folder; ``"folder"``: the
    folder only. Either failing leaves the server on its old weights; if both fail, every rank
    raises ``RuntimeError`` naming the server and both causes. Returns the new version."""
    import logging

    from parallel_models.inference.server.weight_group_push import push_weight_group
    from parallel_models.inference.server.weight_stream import (WeightStreamError,
                                                                 push_weight_stream)

    if mode in ("stream", "group"):
        try:
            push = push_weight_stream if mode == "stream" else push_weight_group
            return push(model, client)
        except WeightStreamError as err:
            logging.getLogger(__name__).warning("%s; falling back to the folder %s", err, folder)
            stream_error = err
    else:
        stream_error = None
    try:
        return push_weights(model, client, folder)
    except Exception as err:  # noqa: BLE001 - one clear error naming both attempts
        first = f" (the {mode} push failed first: {stream_error})" if stream_error else ""
        raise RuntimeError(f"could not push the actor's weights to the rollout server at "
                           f"{client.url}: {type(err).__name__}: {err}{first}; the server "
                           "keeps its previous weights") from err
