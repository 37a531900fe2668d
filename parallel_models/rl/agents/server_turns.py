"""Multi-turn rollouts on the rollout server (``rollout.backend=server``): the turns of a
multi-turn rollout as ``/generate`` requests, for the turn-synchronous driver.

:class:`ServerTurnEngine` gives a :class:`~parallel_models.rl.rollout.server.ServerRollout` the
``generate_samples`` the driver calls. Each turn is one request for every live conversation
(their whole token streams as prompts, ``prompt_seeds`` the turns' seeds, the trainer's EOS as
stop ids, MoE routes when the actor has experts); the server's ``/generate`` takes neither
per-prompt caps nor stop sequences, so the request asks for the largest cap and each sample is
cut here at its own cap and after the first stop sequence it generated (the end of a tool call).
Generation is causal and every row draws on its own, so the kept ids and log-probs are those the
server would have returned had it stopped there (it only generated a few tokens more).

On a TP / PP trainer the first rank of each model-parallel group asks the server and hands the
samples to the others (as ``ServerRollout`` does).
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from parallel_models.rl.rollout.server import _replica_info, _request


def cut_sample(sample: dict, prompt_length: int, cap: int, stop_ids: set,
               stop_sequences: Sequence[Sequence[int]]) -> dict:
    """``sample`` (a /generate sample) as if generation had stopped at a stop id, after a stop
    sequence or at ``cap`` tokens, whichever comes first."""
    ids = list(sample["token_ids"])
    sequences = [list(s) for s in stop_sequences]
    end, reason = min(len(ids), cap), "length"
    for i, token in enumerate(ids[:end]):
        if token in stop_ids or any(i + 1 >= len(s) and ids[i + 1 - len(s):i + 1] == s
                                    for s in sequences):
            end, reason = i + 1, "stop"
            break
    out = {"token_ids": ids[:end], "log_probs": list(sample["log_probs"][:end]),
           "finish_reason": reason}
    if "routes" in sample:
        out["routes"] = list(sample["routes"][:prompt_length + end])
    return out


class ServerTurnEngine:
    """``ServerTurnEngine(rollout)``: ``rollout`` a ``ServerRollout`` (its client, request seed,
    EOS and padding)."""

    def __init__(self, rollout):
        self.rollout = rollout
        self.eos_token_id, self.pad_token_id = rollout.eos_token_id, rollout.pad_token_id
        self.device = rollout.device

    def stop_ids(self, params) -> list[int]:
        return params.stop_ids(self.eos_token_id)

    def generate_samples(self, prompts: Sequence[Sequence[int]], params, *,
                         max_new_tokens: Sequence[int] | None = None,
                         prompt_seeds: Sequence[int] | None = None,
                         stop_sequences: Sequence[Sequence[int]] = (),
                         record_routes: bool = False) -> list[dict]:
        caps = list(max_new_tokens or [params.max_new_tokens] * len(prompts))
        size, rank, src, group = _replica_info()
        samples = None
        if rank == 0:
            wide = params.model_copy(update={"n": 1, "max_new_tokens": max(caps)})
            resp = _request(self.rollout.client, prompts, wide, self.rollout.request_seed(),
                            self.eos_token_id, record_routes, prompt_seeds)
            samples = [r["samples"][0] for r in resp["results"]]
        if size > 1:
            box = [samples]
            dist.broadcast_object_list(box, src=src, group=group)
            samples = box[0]
        stops = set(self.stop_ids(params))
        return [cut_sample(s, len(p), cap, stops, stop_sequences)
                for s, p, cap in zip(samples, prompts, caps)]


__all__ = ["ServerTurnEngine", "cut_sample"]
