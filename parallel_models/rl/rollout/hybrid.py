"""The hybrid engine: the actor trains in its layout (TP x PP x DP) and rolls out in the rollout
engine's TP' layout, in the same processes.

:class:`HybridRollout` owns the rollout layout (:mod:`rollout_layout`: a second
``ParallelLayout`` with its own TP' groups), the rollout model (TP' only, built once in that layout) and the :class:`~weight_sync.WeightSync` that refreshes it from the actor
before a rollout when the actor changed. When the layouts are equal (PP = 1, TP' = TP) the
rollout engine runs on the actor's own weights: nothing is copied.

:meth:`HybridRollout.rollout` is called by every rank with its training data-parallel share of
the prompts. The prompts of all training DP ranks are pooled, dealt round robin over the rollout
DP ranks (each TP' group generates its share), and the samples go back to the training layout:
every rank gets the rows of its own training DP share, in order, as the trainer's rollout dict
(the server backend's format, ``samples_batch.batch_from_response``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from parallel_models.inference import (DEFAULT_BUCKET_BYTES, RolloutEngine, WeightSync,
                                       build_rollout_layout, same_as_training, share_of)
from parallel_models.parallel_layout import ParallelLayout, layout_of
from parallel_models.rl.rollout.samples_batch import batch_from_response


def build_rollout_model(actor, layout: ParallelLayout):
    """An empty (unfilled) CausalLM like ``actor`` in the rollout layout: TP', PP = 1, no SP."""
    from parallel_models import registry

    cls = registry.get_model_class(actor.architecture, "causal_lm", rmpad=True)
    model = cls(actor.config, dtype=actor.dtype, sequence_parallel=False, layout=layout)
    model.requires_grad_(False)
    model.name_or_path = getattr(actor, "name_or_path", None)
    return model


class HybridRollout:
    """``HybridRollout(actor_chunks, tensor_parallel_size, eos_token_id=, pad_token_id=,
    bucket_bytes=, share_weights=, release_copy=, engine_options=)``; build it on every rank at
    once (it makes process groups). ``release_copy``: the rollout copy holds no device memory
    between rollouts (the trainer sets it on CUDA). ``engine_options``: the rollout engine's
    batching settings (``kv_budget_tokens``, ``max_rows``: continuous batching)."""

    def __init__(self, actor_chunks, tensor_parallel_size: int | None = None, *,
                 eos_token_id=None, pad_token_id: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, share_weights: bool | None = None,
                 release_copy: bool = False, engine_options: dict | None = None):
        chunks = list(actor_chunks) if isinstance(actor_chunks, (list, tuple)) else [actor_chunks]
        actor = chunks[0]
        training = layout_of(actor)  # the training layout the actor was built in
        tp = tensor_parallel_size or training.tensor_parallel_size
        self.layout = build_rollout_layout(tp)
        self.training_dp_rank = training.data_parallel_rank
        # share_weights=None: share the actor's weights when the layouts are equal; False: a
        # copy anyway (benches, tests of the copy path on one GPU)
        can_share = same_as_training(self.layout, training) and len(chunks) == 1
        if share_weights and not can_share:
            raise ValueError("share_weights=True needs the rollout layout equal to the training "
                             "one (TP' = TP, PP = 1)")
        self.zero_copy = can_share if share_weights is None else share_weights
        if self.zero_copy:
            model, self.weight_sync = actor, None
        else:
            model = build_rollout_model(actor, self.layout)
            self.weight_sync = WeightSync(chunks, model, self.layout, bucket_bytes)
        self.engine = RolloutEngine(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                    shares_training_weights=self.zero_copy,
                                    **(engine_options or {}))
        self._synced_version: object = None
        # release_copy: between rollouts the rollout copy holds no device memory, as vLLM's
        # sleep level 2 in verl's hybrid engine. Its parameters are not kept anywhere (the sync
        # before each generation writes every one of them from the actor: a host copy would be
        # stale anyway; no pinned host memory either), its module buffers go to host memory
        self.offloader = None
        if release_copy and not self.zero_copy:
            from parallel_models.utils.offload import Offloader

            self.offloader = Offloader([model], refilled=True)
            self.release_memory()

    def release_memory(self) -> None:
        """Free the rollout copy's device memory (with ``release_copy``); the next rollout syncs."""
        if self.offloader is not None:
            self.offloader.offload()
            self._synced_version = None  # its parameters are gone: the next sync refills them

    def resume_memory(self) -> None:
        """The rollout copy's memory back on the device (unwritten until the next sync)."""
        if self.offloader is not None:
            self.offloader.onload()

    @contextlib.contextmanager
    def _on_device(self):
        if self.offloader is None:
            yield
            return
        was_released = self.offloader.is_offloaded
        try:
            with self.offloader.on_device():
                yield
        finally:
            if was_released:
                self._synced_version = None  # released again on the way out

    @property
    def eos_token_id(self):
        return self.engine.eos_token_id

    @property
    def pad_token_id(self):
        return self.engine.pad_token_id

    def sync(self, version=None) -> float:
        """Refresh the rollout model from the actor unless it already holds ``version`` (any
        value naming the actor's weights, e.g. the step index); seconds spent."""
        if self.weight_sync is None or (version is not None and version == self._synced_version):
            return 0.0
        seconds = self.weight_sync.sync()
        self.engine.weights_changed()  # (an FP8 rollout re-quantizes)
        self._synced_version = version
        self.engine.version += 1
        return seconds

    def rollout(self, prompt_ids: list[list[int]], sampling, version=None,
                num_experts: int | None = None, max_new_tokens: list[int] | None = None,
                prompt_seeds: list[int] | None = None) -> dict:
        """This rank's training-DP share of prompts -> its rows (``sampling.n`` per prompt), as
        the trainer's rollout dict. Every rank calls this together. ``num_experts`` (an MoE
        actor): the rows carry their routes too. ``max_new_tokens``: per prompt, a cap on its
        samples' new tokens. ``prompt_seeds``: per prompt, the seed of its samples' draws (they
        travel with the prompt to whichever rollout rank generates it)."""
        with self._on_device():
            return self._rollout(prompt_ids, sampling, version, num_experts, max_new_tokens,
                                 prompt_seeds)

    def _rollout(self, prompt_ids, sampling, version, num_experts, caps, seeds) -> dict:
        self.sync(version)
        prompt_ids = [list(map(int, p)) for p in prompt_ids]
        caps = [None] * len(prompt_ids) if caps is None else list(caps)
        seeds = [None] * len(prompt_ids) if seeds is None else [int(s) for s in seeds]
        layout = self.layout
        pooled: list = [None] * dist.get_world_size()
        dist.all_gather_object(pooled, (self.training_dp_rank, prompt_ids, caps, seeds))
        by_dp = {d: (p, c, s) for d, p, c, s in pooled}
        items = [(d, i, p, by_dp[d][1][i], by_dp[d][2][i]) for d in sorted(by_dp)
                 for i, p in enumerate(by_dp[d][0])]
        mine = [items[j] for j in share_of(items, layout.data_parallel_rank,
                                           layout.data_parallel_size)]
        samples: list[dict] = []
        if mine:
            mine_caps = [c for *_, c, _ in mine]  # all None unless the trainer passed caps
            mine_seeds = [s for *_, s in mine]  # all None unless the trainer passed seeds
            samples = self.engine.generate_samples(
                [p for _, _, p, _, _ in mine], sampling, record_routes=num_experts is not None,
                max_new_tokens=None if None in mine_caps else mine_caps,
                prompt_seeds=None if None in mine_seeds else mine_seeds)
        n = sampling.n
        answers = {}
        if layout.tensor_parallel_rank == 0:
            answers = {(d, i): samples[k * n:(k + 1) * n]
                       for k, (d, i, *_) in enumerate(mine)}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, answers)
        for part in gathered:
            answers.update(part)
        d = self.training_dp_rank
        resp = {"results": [{"prompt_token_ids": p, "samples": answers[(d, i)]}
                            for i, p in enumerate(prompt_ids)],
                "weight_version": self.engine.version}
        batch = batch_from_response(resp, n, self.pad_token_id, num_experts)
        device = self.engine.device
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


__all__ = ["HybridRollout", "build_rollout_model"]
