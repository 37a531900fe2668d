"""The PPO loop: one step is a list of timed phases (rollout -> score -> advantages -> critic
update -> actor update -> metrics), with checkpoints and exact resume.

All roles live on the same ranks (TP x PP inside a model, data parallel across replicas) and
come from the training backend of ``parallel.backend`` (``rl/backends/registry.py``) as one
:class:`~parallel_models.rl.backends.roles.Roles`: actor, reference, critic and reward follow one
protocol (``rl/roles/model_roles.py``), the rollout the rollout interface
(``rl/rollout/interface.py``; ``rollout.backend``: in-process, the hybrid engine, the HTTP
server...). With ``trainer.offload`` on CUDA only the role a phase uses sits on the GPU. The
batch travels between phases as a :class:`~parallel_models.rl.data.batch.RolloutBatch`. Each data-parallel rank takes its share of every
prompt batch (prompts are dealt before they are repeated ``rollout.n`` times, so a grpo / rloo
group never straddles ranks) with draw seeds of (trainer.seed, step, place in the global batch),
so sampled rollouts do not depend on the layout; batch statistics are global over the ranks
(``rl/observe/dp_stats.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from tqdm import tqdm

import parallel_models as pm
from parallel_models.llama.layers.exact import exact_mode
from parallel_models.rl.agents.reward_inputs import (add_environment_rewards, attach_conversations,
                                                 rollout_records)
from parallel_models.rl.algorithms import core as algos
from parallel_models.rl.algorithms.advantages import compute_advantages
from parallel_models.rl.algorithms.mismatch import rollout_mismatch_metrics
from parallel_models.rl.algorithms.rollout_correction import apply_rollout_correction
from parallel_models.rl.backends.builtin_model import BUILTIN_MOE, build_builtin_model
from parallel_models.rl.backends.registry import training_backend
from parallel_models.rl.backends.roles import offload_enabled
from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.data.prompts import prompt_caps
from parallel_models.rl.final_export import export_done, record_export, remove_stale_exports
from parallel_models.rl.greedy_baseline import attach_greedy_baselines
from parallel_models.rl.observe import dp_stats
from parallel_models.rl.observe.metrics import Timer
from parallel_models.rl.rewards.overlong import overlong_metrics, shape_overlong
from parallel_models.utils.fault_points import fault_point

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def summary_line(metrics: dict) -> str:
    """The few numbers of a step worth a log line (``trainer.log_every``)."""
    keys = ("reward/mean", "val/accuracy", "kl/actor_ref", "response_length/mean",
            "actor/pg_loss", "timing/step_s")
    return ", ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics)


class PPOTrainer:
    def __init__(self, cfg):
        from parallel_models.rl.data.prompts import PromptLoader, prompt_datasets
        from parallel_models.rl.observe.metrics import MetricsLogger

        self.cfg = cfg
        par = cfg.parallel
        self.backend = training_backend(par.backend)
        self.backend.check_model(cfg)  # fail before the process groups when the model cannot run
        pm.init_parallel(tensor_parallel_size=par.tensor_parallel_size,
                         pipeline_parallel_size=par.pipeline_parallel_size,
                         sequence_parallel=par.sequence_parallel,
                         expert_model_parallel_size=par.expert_parallel_size,
                         context_parallel_size=par.context_parallel_size)
        self.dp_rank = mpu.get_data_parallel_rank()
        self.dp_size = mpu.get_data_parallel_world_size()
        tcfg = cfg.trainer
        os.makedirs(tcfg.output_dir, exist_ok=True)
        self._seed_everything(tcfg.seed)
        model_path = self._model_path()
        from parallel_models.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(cfg.model.tokenizer or model_path, what="actor tokenizer")
        self.roles = self.backend.build_roles(cfg, self.tokenizer, model_path)
        self.actor, self.ref, self.critic = self.roles.actor, self.roles.reference, self.roles.critic
        self.reward, self.rollout = self.roles.reward, self.roles.rollout
        alg = cfg.algorithm
        if alg.kl_ctrl == "adaptive":
            self.kl_ctrl = algos.AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon)
        else:
            self.kl_ctrl = algos.FixedKLController(alg.kl_coef)
        d = cfg.data
        self.dataset, val_dataset = prompt_datasets(d, self.tokenizer)
        self.loader = PromptLoader(self.dataset, batch_size=d.batch_size, shuffle=d.shuffle,
                                   seed=d.seed)
        if _rank() == 0 and not cfg.model.tokenizer and cfg.model.path in (None, BUILTIN_MOE):
            self._note_builtin_tokenizer(self.dataset, val_dataset)
        self.validator = None
        if val_dataset is not None:
            from parallel_models.rl.observe.evaluation import Validator

            self.validator = Validator(val_dataset, self.tokenizer, d.val_batch_size or d.batch_size,
                                       num_samples=tcfg.val_samples_logged, dp_rank=self.dp_rank,
                                       dp_size=self.dp_size, dp_group=mpu.get_data_parallel_group())
        trackers = []
        if _rank() == 0:
            from parallel_models.rl.observe.trackers import build_trackers

            trackers = build_trackers(tcfg.loggers, tcfg.output_dir, tcfg.project_name,
                                      tcfg.experiment_name, cfg.to_dict())
        self.metrics = MetricsLogger(tcfg.output_dir, tensorboard="tensorboard" in tcfg.loggers,
                                     trackers=trackers)
        self.step_index = 0
        self.sampling = cfg.rollout.sampling_params()
        fault_point("start:before_resume")
        if tcfg.resume:
            self.resume()
        fault_point("start:after_resume")
        if hasattr(self.rollout, "start_producer"):  # trainer.mode=async (rl/async_rollout/)
            self.rollout.start_producer(self)
        # the rollout starts from the trainer's (possibly resumed) actor
        self._update_rollout_weights()
        self._offload_all()  # each phase brings what it needs to the GPU

    # ---- set-up helpers -------------------------------------------------------------------------
    def _seed_everything(self, seed: int) -> None:
        # differs across data-parallel replicas, agrees within a TP group (the rollout's draws
        # do not use it: each prompt has a seed of its own, see prompt_seeds)
        s = seed + 1000 * self.dp_rank
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)

    def _note_builtin_tokenizer(self, *datasets) -> None:
        """Warn when the built-in tokenizer rewrites the run's prompts (lowercase, no accents)."""
        from parallel_models.tokenizer import builtin_tokenizer_note

        for ds in filter(None, datasets):
            key, mkey = ds.prompt_key, ds.messages_key
            texts = [rec[key] if rec.get(mkey) is None else
                     " ".join(m["content"] for m in rec[mkey]) for rec in ds.records]
            note = builtin_tokenizer_note(texts, ds.path or "the prompts")
            if note:
                logger.warning(note)

    def _model_path(self) -> str:
        moe = self.cfg.model.path == BUILTIN_MOE
        if self.cfg.model.path and not moe:
            return self.cfg.model.path
        from parallel_models.tokenizer import build_builtin_tokenizer

        folder = os.path.join(self.cfg.trainer.output_dir, "builtin_moe" if moe else "builtin_model")
        if _rank() == 0 and not os.path.isfile(os.path.join(folder, "config.json")):
            build_builtin_model(folder, build_builtin_tokenizer(), seed=self.cfg.trainer.seed,
                                moe=moe)
        _barrier()
        return folder

    # ---- offload (CUDA): only the role a phase uses stays on the GPU ---------------------------------
    def _offload_enabled(self) -> bool:
        return offload_enabled(self.cfg)

    def _use(self, role, with_optimizer: bool = False):
        """``role`` (and its optimizer states) on the device for a phase with trainer.offload;
        without it, an update phase gets what the role releases between updates back."""
        offload = self._offload_enabled()
        if role is None or not (offload or with_optimizer):
            return contextlib.nullcontext()
        return role.on_device(with_optimizer=with_optimizer) if offload else role.updating()

    def _offload_all(self) -> int:
        """Every role to host memory (trainer.offload on CUDA); returns the bytes moved."""
        if not self._offload_enabled():
            return 0
        self.rollout.release_memory()
        return sum(role.offload() for role in self.roles.resident())

    def _update_rollout_weights(self) -> None:
        """Tell the rollout the actor's weights changed (``version``: the step index). A rollout
        that moves them now (``pushes_weights``: the HTTP server) gets the actor on the device;
        the others only mark their copy stale (see ``rl/rollout/interface.py``)."""
        pushing = self.rollout.pushes_weights
        with self._use(self.actor) if pushing else contextlib.nullcontext():
            self.rollout.update_weights(self.step_index)

    # ---- one PPO step: the phases --------------------------------------------------------------
    def step(self) -> dict:
        timings: dict[str, float] = {}
        memory: dict[str, float] = {}

        def phase(name, fn, *args):  # rollout.exact: every phase on the exact kernels
            with Timer(name, timings, memory), exact_mode(self.cfg.rollout.exact):
                return fn(*args)

        batch = phase("gen", self.rollout_phase)
        fault_point("step:after_rollout")
        metrics = phase("score", self.score_phase, batch)
        metrics.update(self.rollout_metrics)  # dynamic sampling's counts
        metrics.update(phase("adv", self.advantage_phase, batch))
        minibatches = self.minibatches(batch)
        train = phase("train_critic", self.critic_update_phase, minibatches)
        fault_point("step:mid_update")
        train.update(phase("train_actor", self.actor_update_phase, minibatches))
        metrics = phase("metrics", self.metrics_phase, batch, metrics, train)
        rollout_metrics = getattr(self.rollout, "metrics", None)
        if rollout_metrics:  # a multi-turn rollout's turns, tool calls and budget cuts
            metrics.update(dp_stats.data_parallel_mean(dict(rollout_metrics)))
        self.step_index += 1
        if self.rollout.pushes_weights:  # the weights move now: a phase of its own
            phase("sync", self._update_rollout_weights)
        else:  # a copy refilled inside the next rollout ("gen"), or nothing to move
            self._update_rollout_weights()
        metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
        metrics["timing/step_s"] = sum(timings.values())
        metrics.update({f"memory/{k}": v for k, v in memory.items()})
        return metrics

    rollout_metrics: dict = {}

    def rollout_phase(self) -> RolloutBatch:
        """This rank's prompts of the next batch, each sampled ``rollout.n`` times; with
        ``algorithm.dynamic_sampling`` the groups whose rewards differ of as many prompt batches
        as it takes (``rl/data/dynamic_sampling.py``), already scored."""
        alg = self.cfg.algorithm
        if not alg.dynamic_sampling:
            self.rollout_metrics = {}
            return self._draw_rollout()[0]
        from parallel_models.rl.data.dynamic_sampling import collect_groups

        def draw(round_index: int):
            batch, mine = self._draw_rollout(round_index)
            batch.scores = self._score_rewards(batch)
            return batch, mine

        batch, self.rollout_metrics = collect_groups(
            draw, self.cfg.data.batch_size, alg.max_gen_batches, self.dp_rank, self.dp_size,
            mpu.get_data_parallel_group() if self.dp_size > 1 else None)
        self._global_batch_rows = self.cfg.data.batch_size * self.cfg.rollout.n
        return batch

    def _draw_rollout(self, round_index: int = 0) -> tuple[RolloutBatch, list[int]]:
        """This rank's share of the next prompt batch rolled out, and the prompts' places in the
        global batch; ``round_index`` > 0 (dynamic sampling's extra batches of a step): draw
        seeds of global indices ``round_index * batch size + i``."""
        records = self.loader.next_batch()
        prompt_ids = records["input_ids"] if isinstance(records, dict) else records[0]
        self._global_batch_rows = len(prompt_ids) * self.cfg.rollout.n
        mine = [i for i in range(len(prompt_ids)) if i % self.dp_size == self.dp_rank]
        caps = None
        if self.cfg.data.max_new_tokens_key:  # per-prompt response caps from the dataset
            caps = prompt_caps(records, mine, self.cfg.data, self.cfg.rollout.max_new_tokens)
        offset = round_index * len(prompt_ids)
        with self._use(self.actor):  # (a multi-turn rollout also takes the records)
            batch = self._rollout([prompt_ids[i] for i in mine], max_new_tokens=caps,
                                  prompt_seeds=self.prompt_seeds([offset + i for i in mine]),
                                  **rollout_records(self.rollout, records, mine))
        if isinstance(records, dict) and "records" in records:
            # each response carries its prompt's dataset record (reward functions read its fields)
            batch["records"] = [records["records"][i] for i in mine for _ in range(self.cfg.rollout.n)]
            # structured chat prompts for a reward model with another chat template (one per
            # sample, None for plain prompts)
            key = self.cfg.data.messages_key
            msgs = [records["records"][i].get(key) for i in mine]
            batch["messages"] = [m for m in msgs for _ in range(self.cfg.rollout.n)]
        attach_greedy_baselines(self, batch, records, prompt_ids, mine, caps)  # e.g. ReMax
        attach_conversations(batch)  # multi-turn: the reward sees the conversation
        return batch, [offset + i for i in mine]

    def _score_rewards(self, batch: RolloutBatch) -> torch.Tensor:
        """The training rewards: the reward's scores, plus a multi-turn environment's rewards,
        plus the overlong shaping (``reward.overlong_buffer``, ``rl/rewards/overlong.py``)."""
        scores = self.reward.score(batch)  # a reward model brings itself to the device
        scores = add_environment_rewards(batch, scores)
        return shape_overlong(scores, batch.response_mask, self.cfg)

    def prompt_seeds(self, indices: list[int], step: int | None = None) -> list[int] | None:
        """The draw seeds of the step's prompts at ``indices`` (their places in the global
        batch): a function of (trainer.seed, step, index) only, so the samples are the same at
        any layout and after a resume elsewhere (``row_sampling.prompt_seed``); None when greedy.
        ``step``: another stream than the current step's (validation)."""
        if self.sampling.greedy and step is None:
            return None
        from parallel_models.inference import prompt_seed

        step = self.step_index if step is None else step
        return [prompt_seed(self.cfg.trainer.seed, step, i) for i in indices]

    def _rollout(self, prompt_ids: list[list[int]], sampling=None,
                 max_new_tokens: list[int] | None = None,
                 prompt_seeds: list[int] | None = None, **extra) -> RolloutBatch:
        return self.rollout.generate(prompt_ids, sampling or self.sampling,
                                     max_new_tokens=max_new_tokens, prompt_seeds=prompt_seeds,
                                     **extra)

    def score_phase(self, batch: RolloutBatch) -> dict:
        """Old log-probs (actor), reference log-probs, values (critic) and scores (reward)."""
        replay = self.cfg.actor.router_replay  # MoE only (config check)
        moe = self.roles.num_experts is not None
        routing = dict(replay=replay == "R3", record=replay == "R2") if moe else {}
        with self._use(self.actor):  # R3 replays the rollout's routes, R2 records its own
            batch.old_log_probs = self.actor.log_probs(batch, **routing)
        mismatch = rollout_mismatch_metrics(batch, getattr(self.actor, "route_session", None))
        if replay == "R2":
            batch.routes = self.actor.recorded_routes
        if self.ref is not None:
            ref_routing = {"replay": True} if self.cfg.actor.router_replay_reference else {}
            with self._use(self.ref):
                batch.ref_log_probs = self.ref.log_probs(batch, **ref_routing)
        if self.critic is not None:
            with self._use(self.critic):
                batch.values = self.critic.values(batch)
        if batch.scores is None:  # (dynamic sampling scored its rollouts already)
            batch.scores = self._score_rewards(batch)  # a reward model brings itself to the device
        metrics = dp_stats.data_parallel_mean(dict(getattr(self.reward, "metrics", None) or {}))
        metrics.update(overlong_metrics(batch.response_mask, self.cfg))
        metrics.update(mismatch)
        records = batch.get("records") or []
        metrics.update(dp_stats.grouped_means(batch.scores.tolist(),
                                              [r.get("data_source") for r in records]))
        return metrics  # e.g. reward/truncated, reward/<data_source>/mean

    def validate_phase(self) -> dict:
        """Roll out the validation set (greedy unless trainer.val_greedy=false; one response per
        prompt), score it with the training reward, log sample generations; ``val/...`` metrics."""
        params = self.sampling.model_copy(update={"n": 1, "greedy": self.cfg.trainer.val_greedy})
        # sampled validation: prompt seeds of (seed, -(step + 1), index in the validation set),
        # a stream apart from the training steps'; the validator hands out its prompts in order
        mine, done = self.validator.my_indices(), [0]

        def rollout(prompt_ids, records):
            indices = mine[done[0]:done[0] + len(prompt_ids)]
            done[0] += len(prompt_ids)
            seeds = None if params.greedy else self.prompt_seeds(indices, -(self.step_index + 1))
            with self._use(self.actor):
                batch = self._rollout(prompt_ids, params, prompt_seeds=seeds)
            batch["records"] = list(records)
            return batch

        timings: dict[str, float] = {}
        with Timer("val", timings):
            metrics, rows = self.validator.run(rollout, lambda b: (self.reward.score(b), {}))
        self.metrics.log_samples(self.step_index, rows)
        metrics["timing/val_s"] = timings["val"]
        return metrics

    def advantage_phase(self, batch: RolloutBatch) -> dict:
        """The advantages, with the rollout correction (``actor.rollout_correction``): its
        weights into the batch, and its rejected responses out of ``response_mask`` after the
        advantages (their rewards still count in their groups' baselines)."""
        metrics, kept_mask = apply_rollout_correction(batch, self.cfg.actor)
        metrics.update(compute_advantages(batch, self.cfg.algorithm, self.kl_ctrl))
        if kept_mask is not None:
            batch.response_mask = kept_mask
        return metrics

    def minibatches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """Every PPO epoch's shuffled minibatches of this rank's rows, in order."""
        seed = (self.cfg.trainer.seed * 1_000_003 + self.step_index) * 101
        return [mb for epoch in range(self.cfg.actor.ppo_epochs)
                for mb in batch.minibatches(self.cfg.actor.mini_batch_size, self.dp_size,
                                            seed + epoch)]

    def _update_phase(self, role, minibatches: list[RolloutBatch]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        if role is None:
            return out
        with self._use(role, with_optimizer=True):
            for mb in minibatches:
                for k, v in role.update(mb).items():
                    out.setdefault(k, []).append(float(v))
        return out

    def critic_update_phase(self, minibatches: list[RolloutBatch]) -> dict[str, list[float]]:
        return self._update_phase(self.critic, minibatches)

    def actor_update_phase(self, minibatches: list[RolloutBatch]) -> dict[str, list[float]]:
        return self._update_phase(self.actor, minibatches)

    def metrics_phase(self, batch: RolloutBatch, metrics: dict, train: dict) -> dict:
        """The step's metrics, global over data-parallel ranks; updates the KL controller."""
        mask = batch.response_mask.float()
        if self.ref is not None:
            kl = algos.kl_penalty(batch.old_log_probs, batch.ref_log_probs, "k1")
            metrics["kl/actor_ref"] = dp_stats.masked_mean(kl, mask)
        local = {k: sum(v) / len(v) for k, v in train.items()}  # already global per update
        metrics.update(dp_stats.data_parallel_mean(local))
        metrics.update({
            "reward/max": dp_stats.data_parallel_max(batch.scores),
            "reward/min": -dp_stats.data_parallel_max(-batch.scores),
            "reward/mean": dp_stats.row_mean(batch.scores),
            "response_length/mean": dp_stats.row_mean(mask.sum(-1)),
            "advantages/mean": dp_stats.masked_mean(batch.advantages, mask),
            "returns/mean": dp_stats.masked_mean(batch.returns, mask),
        })
        if self.cfg.algorithm.kl_in_reward and "kl/current_kl" in metrics:
            # per-token KL (mean over responses) and the global batch size: the controller's
            # convention, see algorithms.AdaptiveKLController
            self.kl_ctrl.update(metrics["kl/current_kl"], self._global_batch_rows)
        metrics["kl/coef"] = float(self.kl_ctrl.value)
        return metrics

    # ---- loop ------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        tcfg = self.cfg.trainer
        from parallel_models.rl import checkpointing

        finished = checkpointing.finished_run_summary(self)
        if finished is not None:  # --resume of a run that already reached total_steps
            if tcfg.save_hf_at_end and not export_done(tcfg.output_dir, self.step_index):
                self._export_final()  # it was killed before its export finished
                finished["exported"] = True
            if _rank() == 0:
                print(json.dumps(finished))
            return []
        history = []
        if _rank() == 0:  # the resolved config of the run, beside its outputs
            self.cfg.save(os.path.join(tcfg.output_dir, "config.yaml"))
        if self.validator is not None and tcfg.val_before_train and self.step_index == 0:
            self.metrics.log(0, self.validate_phase())
        bar = tqdm(range(self.step_index, tcfg.total_steps), desc="ppo", disable=_rank() != 0,
                   initial=self.step_index, total=tcfg.total_steps)
        for _ in bar:
            metrics = self.step()
            last = self.step_index == tcfg.total_steps
            if self.validator is not None and tcfg.test_freq and (
                    self.step_index % tcfg.test_freq == 0 or last):
                metrics.update(self.validate_phase())
            self.metrics.log(self.step_index, metrics)
            fault_point("step:after_metrics_logged")
            history.append(metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            kl=f"{metrics.get('kl/actor_ref', 0.0):.4f}")
            if _rank() == 0 and (self.step_index % tcfg.log_every == 0 or last):
                logger.info("step %d/%d: %s", self.step_index, tcfg.total_steps,
                            summary_line(metrics))
            if tcfg.save_every and (self.step_index % tcfg.save_every == 0
                                                      or self.step_index == tcfg.total_steps):
                self.save_checkpoint()
        self.metrics.close()
        if _rank() == 0:
            from parallel_models.rl.observe.plots import plot_training_curves

            plot_training_curves(os.path.join(tcfg.output_dir, "metrics.jsonl"),
                                 os.path.join(tcfg.output_dir, "reward_curve.png"),
                                 title=tcfg.experiment_name or tcfg.output_dir)
        if tcfg.save_hf_at_end:
            self._export_final()
        return history

    def _export_final(self) -> None:
        """``actor_hf/`` (and ``critic_hf/``), the backend's way, then ``final_export.json``."""
        if self._offload_enabled():
            for role in (self.actor, self.critic):
                if role is not None:
                    role.onload()
        if _rank() == 0:
            remove_stale_exports(self.cfg.trainer.output_dir)
        _barrier()
        fault_point("export:start")
        self.backend.export_hf(self.roles, self.cfg.trainer.output_dir, self.tokenizer)
        _barrier()
        if _rank() == 0:
            record_export(self.cfg.trainer.output_dir, self.step_index)

    # ---- checkpoints -----------------------------------------------------------------------------
    def _ckpt_root(self) -> str:
        from parallel_models.rl import checkpointing

        return checkpointing.checkpoint_root(self.cfg.trainer.output_dir)

    def _trainable(self):
        return self.roles.trainable()

    def save_checkpoint(self) -> str:
        """Models and optimizer states (megatron-core dist checkpoint, reshardable), trainer state,
        RNG and config, atomically; see ``rl/checkpointing.py``."""
        from parallel_models.rl import checkpointing

        return checkpointing.save_trainer_checkpoint(self)

    def latest_checkpoint(self) -> str | None:
        from parallel_models.rl import checkpointing

        return checkpointing.latest_checkpoint(self._ckpt_root())

    def resume(self, path: str | None = None) -> None:
        """Continue from ``path`` (default: the latest checkpoint), at any TP/PP/DP layout."""
        from parallel_models.rl import checkpointing

        checkpointing.resume_trainer(self, path)
