"""The rollout of an async run, as the trainer sees it (the rollout interface,
``rl/rollout/interface.py``), over a :class:`~parallel_models.rl.rollout.server.ServerRollout`:

- ``generate`` of the step's training prompts (the first call of the trainer's rollout phase
  with the planned prompts, seeds and sampling) takes their samples from the producer's queue
  (``producer.py``); a sample more than ``rollout.max_staleness`` versions behind is
  regenerated under the current weights or dropped from the update (``rollout.stale_policy``);
  any other call (validation, a greedy baseline) generates now; the batch carries each token's
  trainer version (the list column ``token_versions``; with ``rollout.partial`` a sample's tokens
  may come from two versions or more, its staleness counts the oldest);
- ``update_weights`` pushes the weights (a trainer of one process: a snapshot streamed on a
  thread while it trains on, ``inference/server/background_push.py``; else the server
  backend's push); the producer asks for the steps they allow once the server holds them;
- ``metrics``: ``async/staleness_mean``, ``async/staleness_max``, ``async/queue_size`` (samples
  ready beyond the step's), ``async/dropped_samples``, ``async/regenerated_samples``,
  ``async/partial_samples`` (drawn under more than one version), ``async/trainer_idle_s`` (the
  trainer waiting for samples; with a push in flight whose version a sample's tokens carry, also
  for that push), ``timing/weight_push_wait_s``, ``timing/weight_snapshot_s`` (the last
  background push: waiting for the one before, the snapshot) and ``timing/weight_push_s`` (the
  last one answered: its send until the server's answer) and ``async/rollout_idle_s`` (time with
  no request of the producer at the server: it waited for weights) of the step.

Only the first rank of each model-parallel group (one training replica) runs a producer and
talks to the server; the step's batch reaches the group's other ranks by broadcast.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from parallel_models.rl.async_rollout.fleet import rollout_fleet
from parallel_models.rl.async_rollout.producer import Producer, StepPlan, request_key
from parallel_models.rl.async_rollout.versions import (PolicyVersions, sample_staleness,
                                                       too_stale)
from parallel_models.rl.rollout.interface import batch_from_dict
from parallel_models.rl.rollout.samples_batch import batch_from_response
from parallel_models.rl.rollout.server import _replica_info, _request

logger = logging.getLogger(__name__)


class AsyncServerRollout:
    """``AsyncServerRollout(inner, cfg, fleet)``: ``inner`` the server backend's rollout (its
    client, model and tokens), ``fleet`` the server (``fleet.py``)."""

    pushes_weights = True

    def __init__(self, inner, cfg, fleet):
        from parallel_models.inference import RolloutClient

        self.inner, self.cfg, self.fleet = inner, cfg, fleet
        r = cfg.rollout
        self.max_staleness, self.stale_policy = r.max_staleness, r.stale_policy
        self.sampling = r.sampling_params()
        self.versions = PolicyVersions()
        self.version = 0
        self.pusher = background_push_of(inner, cfg, self.versions)  # None: pushes inline
        self.size, self.rank, self.src, self.group = _replica_info()
        self.client = RolloutClient(fleet.url, api_key=os.environ.get("PARALLEL_MODELS_API_KEY"))
        self.plan: StepPlan | None = None      # the trainer's steps (every rank)
        self.producer: Producer | None = None  # the first rank of a replica
        self.metrics: dict = {}
        self._drawing = False   # inside the trainer's rollout phase
        self._consumed = -1     # the last step whose queued samples were handed out

    # ---- the rollout interface ---------------------------------------------------------------
    def start_producer(self, trainer) -> None:
        """Start producing the trainer's steps from its (possibly resumed) state: its loader,
        step index, data-parallel place and run seed."""
        caps = None
        if self.cfg.data.max_new_tokens_key:  # per-prompt response caps (the trainer's rule)
            from parallel_models.rl.data.prompts import prompt_caps

            def caps(records, rows):
                return prompt_caps(records, rows, self.cfg.data, self.cfg.rollout.max_new_tokens)

        def plan():
            return StepPlan(trainer.loader, trainer.step_index, dp_rank=trainer.dp_rank,
                            dp_size=trainer.dp_size, seed=self.cfg.trainer.seed,
                            greedy=self.sampling.greedy, caps=caps)

        self.plan = plan()
        draw = trainer.rollout_phase

        def rollout_phase():  # only the training draw takes queued samples (not validation)
            self._drawing = True
            try:
                return draw()
            finally:
                self._drawing = False

        trainer.rollout_phase = rollout_phase
        if self.rank == 0:
            self.producer = Producer(plan(), self.versions, self._request, self.max_staleness,
                                     self.cfg.trainer.total_steps)
            self.producer.start()

    def update_weights(self, version) -> None:
        if self.pusher is not None:  # snapshot now, sent while the trainer goes on
            self.pusher.push(int(version))
            self.version = self.inner.version = int(version)
            return
        self.inner.update_weights(version)
        self.version = int(version)
        if self.rank == 0:
            server_version = self.inner.server_version
            if server_version is None:  # (a push that does not report it)
                server_version = self.client.health()["weight_version"]
            self.versions.pushed(self.version, server_version)

    def generate(self, prompt_ids, sampling, *, max_new_tokens=None, prompt_seeds=None):
        planned = self.plan.at(self.version) if self.plan is not None else None
        if (planned is None or not self._drawing or planned.step == self._consumed
                or planned.key(self.sampling) != request_key(prompt_ids, sampling, prompt_seeds,
                                                             max_new_tokens)):
            if self.pusher is not None:  # (validation: on the weights just pushed)
                self.pusher.wait()
            return self.inner.generate(prompt_ids, sampling, max_new_tokens=max_new_tokens,
                                       prompt_seeds=prompt_seeds)
        self._consumed = planned.step  # (a greedy baseline of the same prompts: generated now)
        out = self._step_samples(planned) if self.rank == 0 else None
        if self.size > 1:
            box = [out]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            out = box[0]
        batch, metrics = out
        metrics["async/staleness_max"] = _dp_max(metrics["async/staleness_max"])
        self.metrics = metrics
        device = self.inner.device
        if device is not None:
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        return batch_from_dict(batch)

    def release_memory(self) -> None:
        """Nothing here: the server's memory is the server's."""

    def resume_memory(self) -> None:
        """Nothing here (see :meth:`release_memory`)."""

    def close(self) -> None:
        """Stop the producer and the server this run started (after the push in flight)."""
        if self.pusher is not None:
            try:
                self.pusher.wait()
            except RuntimeError as err:  # (raised to the trainer already, or after its end)
                logger.warning("%s", err)
        if self.producer is not None:
            self.producer.stop()
            self.producer = None
        self.client.close()
        self.fleet.stop()

    # ---- the first rank of a replica ---------------------------------------------------------
    def _request(self, planned):
        """``planned``'s samples now: the rollout dict and each sample's tokens' versions."""
        inner = self.inner
        resp = _request(self.client, planned.prompt_ids, self.sampling, None, inner.eos_token_id,
                        inner.num_experts is not None, planned.prompt_seeds, planned.prompt_caps)
        batch = batch_from_response(resp, self.sampling.n, inner.pad_token_id, inner.num_experts)
        server = resp["weight_version"]  # (a server without --partial-rollouts: every token)
        token_versions = [s.get("weight_versions") or [server] * max(len(s["token_ids"]), 1)
                          for r in resp["results"] for s in r["samples"]]
        return batch, token_versions

    def _step_samples(self, planned) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        pusher = self.pusher
        item = self.producer.take(planned.step, check=pusher.check if pusher else None)
        ready = self.producer.ready() * len(item.token_versions)
        batch, token_versions = item.batch, item.token_versions
        if pusher is not None and pusher.in_flight and not (
                {v for tokens in token_versions for v in tokens} <= self.versions.mapping().keys()):
            pusher.wait()  # tokens of weights whose push has not answered yet (partial rollouts)
        trainer_idle = time.perf_counter() - t0
        staleness = self._staleness(token_versions)
        stale = too_stale(staleness, self.max_staleness)
        dropped = regenerated = 0
        if any(stale) and self.stale_policy == "regenerate":
            if pusher is not None:
                pusher.wait()  # regenerated under the trainer's current weights
            batch, token_versions = self._request(planned)
            regenerated = sum(stale)
            staleness = self._staleness(token_versions)
            stale = too_stale(staleness, self.max_staleness)
        if any(stale):  # (drop; or weights changed under a regeneration: never trained on)
            batch["response_mask"][torch.tensor(stale)] = 0
            dropped = sum(stale)
        # each token's trainer version (-1: not a push of this run), a column of the batch
        batch["token_versions"] = [[-1 if v is None else v for v in tokens] for tokens in
                                   self._trainer_versions(token_versions)]
        kept = [s for s, bad in zip(staleness, stale) if not bad] or [0]
        metrics = {"async/staleness_mean": sum(kept) / len(kept),
                   "async/staleness_max": float(max(kept)),
                   "async/queue_size": float(ready), "async/dropped_samples": float(dropped),
                   "async/regenerated_samples": float(regenerated),
                   "async/partial_samples": float(sum(len(set(v)) > 1 for v in token_versions)),
                   "async/trainer_idle_s": trainer_idle,
                   "async/rollout_idle_s": self.producer.take_idle()}
        if pusher is not None:  # the last push's phases (send: overlapped with training)
            metrics.update({f"timing/weight_{k}": v for k, v in pusher.seconds.items()})
        return batch, metrics

    def _trainer_versions(self, token_versions) -> list:
        by_server = self.versions.mapping()  # (one lookup per token, no lock: ~1e5 tokens)
        return [[by_server.get(v) for v in tokens] for tokens in token_versions]

    def _staleness(self, token_versions) -> list:
        return sample_staleness(self.version, self._trainer_versions(token_versions))


def background_push_of(inner, cfg, versions):
    """A :class:`~parallel_models.inference.BackgroundPush` of ``inner``'s (the server
    rollout's) model telling ``versions`` what the server holds, or None where the push stays
    inline (several trainer processes, a LoRA actor, ``rollout.weight_push`` group or folder)."""
    from parallel_models.inference import BackgroundPush

    if dist.is_initialized() and dist.get_world_size() > 1:
        return None
    if cfg.rollout.weight_push != "stream" or getattr(inner.model, "lora_settings", None):
        return None
    return BackgroundPush(inner.model, inner.client, versions.pushed, versions.wake)


def _dp_max(value: float) -> float:
    """``value``'s maximum over the data-parallel ranks."""
    from parallel_models.rl.observe import dp_stats

    return dp_stats.data_parallel_max(torch.tensor([float(value)]))


def async_server_rollout(context) -> AsyncServerRollout:
    """``trainer.mode=async``: the rollout server (``rollout.server_url`` or one this run
    starts on ``context.model_path``) behind an :class:`AsyncServerRollout`."""
    from parallel_models.rl.rollout.server import server_from_context

    fleet = rollout_fleet(context.cfg, context.model_path)
    return AsyncServerRollout(server_from_context(context, url=fleet.url), context.cfg, fleet)


__all__ = ["AsyncServerRollout", "async_server_rollout"]
