"""The HTTP rollout server as a rollout backend (``rollout.backend=server``): the trainer's
batches come from ``parallel-models-serve`` at ``rollout.server_url``, and the actor's weights go
to it after every update (``rollout.weight_push``: a stream over HTTP, a broadcast over a
process group with the server, or an HF folder the server loads; the folder is also the fallback).

:func:`server_rollout` asks the server for one rank's prompts: only the first rank of each
model-parallel group (TP x PP: one training DP replica) talks to the server, and the batch is
broadcast to the group's other ranks. The trainer's EOS travels as stop ids (the server's
tokenizer may differ). Each prompt carries the trainer's draw seed (``prompt_seeds``: run seed,
step, place in the global batch), so the samples are those the in-process engine draws, at any
layout, whatever else the server serves; without them a request has a seed of its own (the
trainer's seed, the weights' version and the DP rank).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.rollout.interface import batch_from_dict
from parallel_models.rl.rollout.samples_batch import batch_from_response


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


def _request(client, prompt_ids, params, seed: int | None, eos_token_id, routes: bool,
             prompt_seeds=None, prompt_caps=None) -> dict:
    # the trainer's EOS travels as stop ids (the server's tokenizer may differ)
    wire = params.model_copy(update=dict(
        stop_token_ids=params.stop_ids(eos_token_id), eos_token_id=None, ignore_eos=True,
        seed=None if params.greedy else seed))
    seeds = None if params.greedy or prompt_seeds is None else list(prompt_seeds)
    extra = {} if prompt_caps is None else {"prompt_max_new_tokens": list(prompt_caps)}
    return client.generate([list(map(int, p)) for p in prompt_ids], wire, return_text=False,
                           return_routes=routes, prompt_seeds=seeds, **extra)


def server_rollout(client, prompt_ids, params, seed: int | None = None, device=None, *,
                   eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
                   num_experts: int | None = None, prompt_seeds=None) -> dict:
    """Generate ``params.n`` samples of each prompt on the server with ``params`` (a
    SamplingParams; its EOS, else ``eos_token_id``, and its stop ids are sent as
    ``stop_token_ids``); ``pad_token_id`` pads the batch. ``num_experts`` (an MoE actor): the
    server also returns the routes (``routes``, compact for that many experts).
    ``prompt_seeds``: one seed per prompt, its samples' draws (else ``seed`` for the request)."""
    size, rank, src, group = _replica_info()
    batch = None
    if rank == 0:
        resp = _request(client, prompt_ids, params, seed, eos_token_id, num_experts is not None,
                        prompt_seeds)
        batch = batch_from_response(resp, params.n, pad_token_id, num_experts)
    if size > 1:
        obj = [batch]
        dist.broadcast_object_list(obj, src=src, group=group)
        batch = obj[0]
    if device is not None:
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    return batch


class ServerRollout:
    """``ServerRollout(client, model, folder=, weight_push=, seed=, data_parallel_rank=, device=,
    eos_token_id=, pad_token_id=, num_experts=)``: ``client`` a ``RolloutClient``; ``model`` the
    actor's model (our parallel CausalLM, this rank's shard) whose weights ``update_weights``
    pushes; ``folder`` where the folder push writes; ``seed`` the run's seed (request seeds mix
    it with the version and ``data_parallel_rank``); ``device`` where the batches go."""

    pushes_weights = True

    def __init__(self, client, model, *, folder: str, weight_push: str = "stream",
                 seed: int = 0, data_parallel_rank: int = 0, device=None,
                 eos_token_id=None, pad_token_id: int = 0, num_experts: int | None = None):
        self.client, self.model = client, model
        self.folder, self.weight_push = folder, weight_push
        self.seed, self.data_parallel_rank = seed, data_parallel_rank
        self.device = device
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.num_experts = num_experts
        self.version = 0
        self.server_version: int | None = None  # the server's weight version after the last push

    def update_weights(self, version) -> None:
        """Push the actor's weights to the server now (every rank calls; the actor on the
        device); a failed stream or group push falls back to the folder. A LoRA actor pushes
        its adapters only, streamed, whatever ``rollout.weight_push`` says (``lora/served.py``:
        the server runs them on its base weights)."""
        if getattr(self.model, "lora_settings", None) is not None:
            from parallel_models.lora.server_push import push_adapter_stream

            self.server_version = push_adapter_stream(self.model, self.client)["weight_version"]
            self.version = version
            return
        from parallel_models.inference import push_actor_weights

        self.server_version = push_actor_weights(self.model, self.client, self.folder,
                                                 self.weight_push)
        self.version = version

    def release_memory(self) -> None:
        """Nothing here: the server's memory is the server's."""

    def resume_memory(self) -> None:
        """Nothing here (see :meth:`release_memory`)."""

    def request_seed(self) -> int:
        return (self.seed * 1_000_003 + int(self.version)) * 1009 + self.data_parallel_rank

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling, *,
                 max_new_tokens: Sequence[int] | None = None,
                 prompt_seeds: Sequence[int] | None = None) -> RolloutBatch:
        if max_new_tokens is not None:
            raise ValueError("per-prompt max_new_tokens caps are not sent to the rollout server "
                             "(data.max_new_tokens_key needs rollout.backend=inprocess)")
        out = server_rollout(self.client, prompt_ids, sampling, seed=self.request_seed(),
                             device=self.device, eos_token_id=self.eos_token_id,
                             pad_token_id=self.pad_token_id, num_experts=self.num_experts,
                             prompt_seeds=prompt_seeds)
        return batch_from_dict(out)


def server_from_context(context, url: str | None = None) -> ServerRollout:
    """``rollout.backend=server`` (``registry.ROLLOUT_BACKENDS``): a client of
    ``rollout.server_url`` (or ``url``: an async run's server) (the bearer token, if the server wants one, from the environment's
    ``PARALLEL_MODELS_API_KEY``) pushing ``context.model``."""
    import os

    from parallel_models.errors import ConfigError
    from parallel_models.inference import RolloutClient

    cfg = context.cfg
    if context.model is None:
        raise ConfigError(f"rollout.backend=server: parallel.backend={cfg.parallel.backend} "
                          "has no parallel model of the actor to push to the server")
    client = RolloutClient(url or cfg.rollout.server_url,
                           api_key=os.environ.get("PARALLEL_MODELS_API_KEY"))
    return ServerRollout(client, context.model,
                         folder=os.path.join(cfg.trainer.output_dir, "rollout_weights"),
                         weight_push=cfg.rollout.weight_push, seed=cfg.trainer.seed,
                         data_parallel_rank=context.data_parallel_rank, device=context.device,
                         eos_token_id=context.eos_token_id, pad_token_id=context.pad_token_id,
                         num_experts=context.num_experts)


__all__ = ["ServerRollout", "server_from_context", "server_rollout"]
