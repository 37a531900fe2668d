"""The PPO loop: rollout -> score -> advantages -> PPO epochs, with checkpoints and exact resume.

All roles live on the same ranks (TP inside a model, data parallel across replicas; PP needs the
rollout server). Each data-parallel rank takes its share of every prompt batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from tqdm import tqdm

import parallel_models as pm
from parallel_models.config import ConfigError
from parallel_models.rl import algorithms as algos
from parallel_models.rl.rollout.generation import SamplingParams, generate
from parallel_models.rl.tokenizer import builtin_vocab
from parallel_models.rl.roles import (CriticRole, PolicyRole, RuleReward, data_parallel_mean,
                                      token_level_scores)
from parallel_models.utils.optimizer import OptimConfig, build_optimizer

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def builtin_model_config(vocab_size: int, tokenizer=None):
    """The default job's tiny Llama: 2 layers, hidden 64, 4 heads (2 KV heads)."""
    from transformers import LlamaConfig

    special = {} if tokenizer is None else dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"], **special)


def build_builtin_model(folder: str, tokenizer, seed: int = 0) -> str:
    """The default job's tiny Llama (random weights) and its tokenizer, saved as an HF folder."""
    from transformers import LlamaForCausalLM

    config = builtin_model_config(len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


class PPOTrainer:
    def __init__(self, cfg):
        from parallel_models.rl.data import PromptDataset, PromptLoader
        from parallel_models.rl.metrics import MetricsLogger

        self.cfg = cfg
        par = cfg.parallel
        if par.pipeline_parallel_size > 1:
            raise ConfigError("parallel.pipeline_parallel_size > 1: in-process rollout generation "
                              "needs PP=1 (use TP/DP, or rollout.backend=server)")
        if cfg.model.path:  # fail before starting processes when the model cannot be split
            pm.ModelConfig.from_hf(cfg.model.path).check_tensor_parallel(par.tensor_parallel_size)
        else:
            pm.ModelConfig.from_hf(builtin_model_config(len(builtin_vocab()))).check_tensor_parallel(
                par.tensor_parallel_size)
        pm.init_parallel(tensor_parallel_size=par.tensor_parallel_size,
                         sequence_parallel=par.sequence_parallel)
        self.dp_rank = mpu.get_data_parallel_rank()
        self.dp_size = mpu.get_data_parallel_world_size()
        tcfg = cfg.trainer
        os.makedirs(tcfg.output_dir, exist_ok=True)
        self._seed_everything(tcfg.seed)
        model_path = self._model_path()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_path)
        dtype = cfg.model.dtype
        arch = pm.registry.architecture_of(model_path)
        actor_cls = pm.get_model_class(arch, "causal_lm", rmpad=True)
        self.actor_model = actor_cls.from_pretrained(model_path, dtype=dtype)
        a = cfg.actor
        budget = a.micro_batch_tokens
        self.actor = PolicyRole(self.actor_model, build_optimizer([self.actor_model], OptimConfig(
            lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
            warmup_steps=a.warmup_steps, total_steps=tcfg.total_steps)),
            temperature=cfg.rollout.temperature if not cfg.rollout.greedy else 1.0,
            max_tokens=budget)
        alg = cfg.algorithm
        self.ref = None
        if alg.kl_in_reward or a.use_kl_loss:
            ref_model = actor_cls.from_pretrained(model_path, dtype=dtype)
            ref_model.requires_grad_(False)
            self.ref = PolicyRole(ref_model, None, temperature=self.actor.temperature,
                                  max_tokens=budget)
        self.critic = None
        if alg.adv_estimator == "gae":
            c = cfg.critic
            critic_path = c.path or model_path
            critic_cls = pm.get_model_class(pm.registry.architecture_of(critic_path), "value",
                                            rmpad=True)
            critic_model = critic_cls.from_pretrained(critic_path, dtype=dtype,
                                                      value_head_seed=tcfg.seed)
            self.critic = CriticRole(critic_model, build_optimizer([critic_model], OptimConfig(
                lr=c.lr, weight_decay=c.weight_decay, clip_grad=c.clip_grad,
                warmup_steps=c.warmup_steps, total_steps=tcfg.total_steps)), max_tokens=budget)
        self.reward = self._build_reward()
        if alg.kl_ctrl == "adaptive":
            self.kl_ctrl = algos.AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon)
        else:
            self.kl_ctrl = algos.FixedKLController(alg.kl_coef)
        d = cfg.data
        self.dataset = PromptDataset(d.path, self.tokenizer, prompt_key=d.prompt_key,
                                     messages_key=d.messages_key,
                                     max_prompt_length=d.max_prompt_length,
                                     truncation=d.truncation, chat_template=d.chat_template)
        self.loader = PromptLoader(self.dataset, batch_size=d.batch_size, shuffle=d.shuffle,
                                   seed=d.seed)
        self.metrics = MetricsLogger(tcfg.output_dir, tensorboard=tcfg.tensorboard)
        self.step_index = 0
        r = cfg.rollout
        eos = self.tokenizer.eos_token_id
        self.sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
            top_p=r.top_p, greedy=r.greedy, eos_token_id=eos,
            stop_token_ids=list(r.stop_token_ids or []),
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.rollout_client = None
        if r.backend == "server":
            from parallel_models.rl.rollout.server import RolloutClient

            # the bearer token, if the server wants one, comes from the environment
            self.rollout_client = RolloutClient(r.server_url,
                                                api_key=os.environ.get("PARALLEL_MODELS_API_KEY"))
        if tcfg.resume:
            self.resume()
        if self.rollout_client is not None:
            self._push_weights()  # the server starts from the trainer's (possibly resumed) actor
        self._offload_all()  # each phase brings what it needs to the GPU

    # ---- set-up helpers -------------------------------------------------------------------------
    def _seed_everything(self, seed: int) -> None:
        # sampling differs across data-parallel replicas, agrees within a TP group
        s = seed + 1000 * self.dp_rank
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)

    def _model_path(self) -> str:
        if self.cfg.model.path:
            return self.cfg.model.path
        from parallel_models.rl.tokenizer import build_builtin_tokenizer

        folder = os.path.join(self.cfg.trainer.output_dir, "builtin_model")
        if _rank() == 0 and not os.path.isfile(os.path.join(folder, "config.json")):
            build_builtin_model(folder, build_builtin_tokenizer(), seed=self.cfg.trainer.seed)
        _barrier()
        return folder

    def _build_reward(self):
        r = self.cfg.reward
        if r.type == "rule":
            from parallel_models.rl.rewards import load_reward_function

            return RuleReward(load_reward_function(r.function), self.tokenizer)
        from parallel_models.rl.reward_model import RewardModel  # issue: reward model role

        return RewardModel.from_config(r, self.tokenizer)

    # ---- offload (CUDA): only the role a phase uses stays on the GPU ---------------------------------
    def _offload_enabled(self) -> bool:
        return bool(self.cfg.trainer.offload) and torch.cuda.is_available()

    def _model_of(self, role):
        return role.state.chunks[0] if getattr(role, "state", None) is not None else role.model

    def _use(self, role, with_optimizer: bool = False):
        from parallel_models.utils.offload import on_device

        if role is None:
            return contextlib.nullcontext()
        opt = role.state.optimizer if with_optimizer and getattr(role, "state", None) else None
        return on_device(self._model_of(role), opt, enabled=self._offload_enabled())

    def _offload_all(self) -> None:
        from parallel_models.utils.offload import offload_model, offload_optimizer

        if not self._offload_enabled():
            return
        for role in (self.actor, self.ref, self.critic):
            if role is None:
                continue
            offload_model(self._model_of(role))
            if getattr(role, "state", None) is not None:
                offload_optimizer(role.state.optimizer)
        if hasattr(self.reward, "offload"):
            self.reward.offload()

    # ---- one PPO step ----------------------------------------------------------------------------
    def _push_weights(self) -> None:
        """rollout.backend=server: save the actor (HF folder) and have the server load it."""
        from parallel_models.rl.rollout.server.rollout import push_weights

        folder = os.path.join(self.cfg.trainer.output_dir, "rollout_weights")
        with self._use(self.actor):
            push_weights(self.actor_model, self.rollout_client, folder)

    def _rollout(self, prompt_ids: list[list[int]]) -> dict:
        n = self.cfg.rollout.n
        if self.rollout_client is not None:
            from parallel_models.rl.rollout.server.rollout import server_rollout

            seed = (self.cfg.trainer.seed * 1_000_003 + self.step_index) * 1009 + self.dp_rank
            batch = server_rollout(self.rollout_client, prompt_ids, self.sampling, n, seed=seed,
                                   device=self.actor_model.device)
            batch.pop("weight_version", None)
            batch.pop("rollout_log_probs", None)  # old_log_probs are recomputed by the actor
            return batch
        prompts = [p for p in prompt_ids for _ in range(n)]
        groups = torch.arange(len(prompt_ids)).repeat_interleave(n)
        out = generate(self.actor_model, prompts, self.sampling)
        return {"sequences": out.sequences, "attention_mask": out.attention_mask,
                "prompt_lengths": out.prompt_mask.sum(-1), "response_mask": out.response_mask,
                "group_index": groups}

    def _advantages(self, batch: dict, scores: torch.Tensor) -> dict:
        alg = self.cfg.algorithm
        mask = batch["response_mask"]
        metrics = {}
        token_scores = token_level_scores(scores, mask)
        if alg.kl_in_reward:
            rewards, klm = algos.apply_kl_penalty(token_scores, batch["old_log_probs"],
                                                  batch["ref_log_probs"], mask, self.kl_ctrl,
                                                  alg.kl_penalty, update_kl_ctrl=False)
            metrics.update({f"kl/{k}": v for k, v in klm.items()})
        else:
            rewards = token_scores
        if alg.adv_estimator == "gae":
            adv, ret = algos.compute_gae(rewards, batch["values"], mask, alg.gamma, alg.lam)
        else:
            seq_scores = (rewards * mask).sum(-1)
            if alg.adv_estimator == "grpo":
                adv = algos.compute_grpo_advantages(seq_scores, batch["group_index"], mask)
            else:
                adv = algos.compute_rloo_advantages(seq_scores, batch["group_index"], mask)
            ret = adv.clone()
            if not alg.whiten_advantages:  # compute_gae whitens; undo on request
                adv = (ret - batch["values"]) * mask
        batch.update(advantages=adv, returns=ret, token_level_rewards=rewards)
        return metrics

    def _minibatches(self, batch: dict, epoch: int) -> list[dict]:
        """This PPO epoch's shuffled minibatches (this rank's share of ``mini_batch_size``)."""
        per_rank = max(1, self.cfg.actor.mini_batch_size // self.dp_size)
        n = batch["sequences"].shape[0]
        g = torch.Generator().manual_seed(
            (self.cfg.trainer.seed * 1_000_003 + self.step_index) * 101 + epoch)
        order = torch.randperm(n, generator=g)
        keys = [k for k, v in batch.items() if torch.is_tensor(v) and v.shape[:1] == (n,)]
        return [{k: batch[k][order[i:i + per_rank]] for k in keys} for i in range(0, n, per_rank)]

    def step(self) -> dict:
        from parallel_models.rl.metrics import Timer

        timings = {}
        records = self.loader.next_batch()
        prompt_ids = records["input_ids"] if isinstance(records, dict) else records[0]
        mine = [i for i in range(len(prompt_ids)) if i % self.dp_size == self.dp_rank]
        share = [prompt_ids[i] for i in mine]
        memory: dict[str, float] = {}
        with Timer("gen", timings, memory), self._use(self.actor):
            batch = self._rollout(share)
        if isinstance(records, dict) and "records" in records:
            # structured chat prompts for a reward model with another chat template (one per
            # sample, None for plain prompts); a list, so minibatching leaves it out
            key = self.cfg.data.messages_key
            msgs = [records["records"][i].get(key) for i in mine]
            batch["messages"] = [m for m in msgs for _ in range(self.cfg.rollout.n)]
        with Timer("score", timings, memory):
            with self._use(self.actor):
                batch["old_log_probs"] = self.actor.log_probs(batch)
            if self.ref is not None:
                with self._use(self.ref):
                    batch["ref_log_probs"] = self.ref.log_probs(batch)
            if self.critic is not None:
                with self._use(self.critic):
                    batch["values"] = self.critic.values(batch)
            scores = self.reward.score(batch)
        with Timer("adv", timings, memory):
            metrics = self._advantages(batch, scores)
        metrics.update(getattr(self.reward, "metrics", None) or {})  # e.g. reward/truncated
        train_metrics: dict[str, list[float]] = {}
        minibatches = [mb for epoch in range(self.cfg.actor.ppo_epochs)
                       for mb in self._minibatches(batch, epoch)]
        with Timer("train_critic", timings, memory), self._use(self.critic, True):
            if self.critic is not None:
                for mb in minibatches:
                    for k, v in self.critic.update(mb, self.cfg.critic,
                                                   self.cfg.actor.loss_agg_mode).items():
                        train_metrics.setdefault(k, []).append(float(v))
        with Timer("train_actor", timings, memory), self._use(self.actor, True):
            for mb in minibatches:
                for k, v in self.actor.update(mb, self.cfg.actor, None).items():
                    train_metrics.setdefault(k, []).append(float(v))
        mask = batch["response_mask"].float()
        if self.ref is not None:
            kl = algos.masked_mean(algos.kl_penalty(batch["old_log_probs"], batch["ref_log_probs"],
                                                    "k1"), mask)
            metrics["kl/actor_ref"] = float(kl)
        metrics.update({k: sum(v) / len(v) for k, v in train_metrics.items()})
        metrics.update({
            "reward/mean": float(scores.mean()),
            "reward/max": float(scores.max()),
            "reward/min": float(scores.min()),
            "response_length/mean": float(mask.sum(-1).mean()),
            "advantages/mean": float(algos.masked_mean(batch["advantages"], mask)),
            "returns/mean": float(algos.masked_mean(batch["returns"], mask)),
        })
        metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
        metrics.update({f"memory/{k}_peak_gib": v for k, v in memory.items()})
        metrics = data_parallel_mean(metrics)
        if self.cfg.algorithm.kl_in_reward and "kl/current_kl" in metrics:
            self.kl_ctrl.update(metrics["kl/current_kl"], len(prompt_ids) * self.cfg.rollout.n)
        metrics["kl/coef"] = float(self.kl_ctrl.value)
        self.step_index += 1
        if self.rollout_client is not None:
            self._push_weights()
        return metrics

    # ---- loop ------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        tcfg = self.cfg.trainer
        from parallel_models.rl import checkpointing

        finished = checkpointing.finished_run_summary(self)
        if finished is not None:  # --resume of a run that already reached total_steps
            if _rank() == 0:
                print(json.dumps(finished))
            return []
        history = []
        bar = tqdm(range(self.step_index, tcfg.total_steps), desc="ppo", disable=_rank() != 0,
                   initial=self.step_index, total=tcfg.total_steps)
        for _ in bar:
            metrics = self.step()
            self.metrics.log(self.step_index, metrics)
            history.append(metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                            kl=f"{metrics.get('kl/actor_ref', 0.0):.4f}")
            if tcfg.save_every and (self.step_index % tcfg.save_every == 0
                                    or self.step_index == tcfg.total_steps):
                self.save_checkpoint()
        self.metrics.close()
        if _rank() == 0:
            from parallel_models.rl.metrics import plot_reward_curve

            plot_reward_curve(os.path.join(tcfg.output_dir, "metrics.jsonl"),
                              os.path.join(tcfg.output_dir, "reward_curve.png"))
        if self._offload_enabled():
            for role in (self.actor, self.critic):
                if role is not None:
                    from parallel_models.utils.offload import onload_model

                    onload_model(self._model_of(role))
        if tcfg.save_hf_at_end:
            # the final weights replace those of an earlier (resumed or repeated) run
            self.actor_model.save_pretrained(os.path.join(tcfg.output_dir, "actor_hf"),
                                             overwrite=True)
            if self.critic is not None:
                self.critic.model.save_pretrained(os.path.join(tcfg.output_dir, "critic_hf"),
                                                  overwrite=True)
        return history

    # ---- checkpoints -----------------------------------------------------------------------------
    def _ckpt_root(self) -> str:
        from parallel_models.rl import checkpointing

        return checkpointing.checkpoint_root(self.cfg.trainer.output_dir)

    def _trainable(self):
        roles = {"actor": self.actor}
        if self.critic is not None:
            roles["critic"] = self.critic
        return roles

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
