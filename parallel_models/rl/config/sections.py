"""The sections of the PPO config: pydantic v2 models, one per concern, with bounds and a
description per field (the descriptions become the comments of ``configs/default.yaml``).

Fields shared with other code are defined once and inherited: ``rollout`` takes the sampling
knobs of :class:`~parallel_models.inference.sampling.SamplingFields` (``n``, ``temperature``,
``top_k``, ...), ``actor`` and ``critic`` the optimizer knobs of
:class:`~parallel_models.utils.optimizer.OptimizerFields` (``lr``, ``weight_decay``,
``clip_grad``, ``warmup_steps``, ...). Where the PPO run wants another default than the shared
model (``rollout.n``, ``actor.lr``), :data:`SECTION_DEFAULTS` says so.

Values are checked as they come in: integers accept ``3`` and ``"3"`` but not ``2.5`` or
``true``; floats accept integers and numeric strings (YAML 1.1 reads ``1e-5`` as a string);
strings accept numbers; ``null`` only where a field says so.

What users extend is named, not enumerated: ``algorithm.adv_estimator``, ``actor.policy_loss``,
``algorithm.kl_penalty``, ``actor.kl_loss_type`` (and ``reward.function``) take a registered name
or ``path/to/file.py:function``; the config check (``checks.py``) resolves them against their
registries (``parallel_models.rl.registry``), loading users' files there.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field, StrictBool, field_validator, model_validator

from parallel_models.inference import SamplingFields, SamplingParams
from parallel_models.options import KernelOptions
from parallel_models.rl.config.async_fields import AsyncRolloutFields
from parallel_models.rl.config.correction_fields import (OverlongBufferFields,
                                                          RolloutCorrectionFields)
from parallel_models.rl.config.multi_turn import MultiTurnSection
from parallel_models.rl.config.section_config import SECTION_CONFIG
from parallel_models.utils.optimizer_config import Int, Number, OptimizerFields

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_HELP = ("megatron backend, activation recomputation in the backward: none | selective "
                  "(core attention, megatron-core's selective granularity) | full (each decoder "
                  "layer; not for MoE)")
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")



class ModelSection(BaseModel):
    """The actor model."""

    model_config = SECTION_CONFIG

    path: Optional[str] = Field(None, description="HF folder of the actor; null = build the "
                                                  "built-in tiny Llama, builtin-moe = a tiny "
                                                  "Qwen3-MoE")
    dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = Field(
        "float32", description="float32 | bfloat16 | float16")
    tokenizer: Optional[str] = Field(None, description="null = the tokenizer of model.path (or "
                                                       "the built-in one: one token per "
                                                       "character, text lowercased and accents "
                                                       "stripped)")


class ParallelSection(BaseModel):
    """Model-parallel layout of the actor, reference and critic (data parallel = the rest)."""

    model_config = SECTION_CONFIG

    tensor_parallel_size: Int = Field(1, ge=1, description="divides the attention heads")
    pipeline_parallel_size: Int = Field(1, ge=1, description="pipeline stages of the actor, "
                                         "reference and critic")
    sequence_parallel: StrictBool = Field(False, description="sequence parallel on top of TP")
    expert_parallel_size: Int = Field(1, ge=1, description="MoE: ranks the experts of each MoE "
                                      "layer are split over (inside the data-parallel group; "
                                      "divides num_experts)")
    context_parallel_size: Int = Field(1, ge=1, description="megatron: ranks each packed "
                                       "sequence of the actor, reference, critic and reward "
                                       "model forwards is split over (two mirrored chunks per "
                                       "rank; long sequences)")
    backend: str = Field(
        "megatron", description="megatron (our parallel models; TP/PP/EP/CP) | fsdp (any HF "
                                "causal LM, torch FSDP2 over data-parallel ranks; TP=PP=1)")
    fsdp_replicate_size: Int = Field(1, ge=1, description="fsdp: HSDP replicas (2-D mesh "
                                     "replicate x shard); 1 = shard over all ranks")
    activation_checkpointing: StrictBool = Field(False, description="fsdp: recompute each "
                                                 "decoder layer in the backward")
    fsdp_packed: StrictBool = Field(True, description="fsdp: packed sequences through "
                                    "position_ids (transformers' packed masks / flash varlen); "
                                    "false = padded batches")

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:  # rl/backends/registry.py
        from parallel_models.rl.backends.registry import TRAINING_BACKENDS

        problem = TRAINING_BACKENDS.problem(name)
        if problem:
            raise ValueError(problem)
        return name


class DataSection(BaseModel):
    """The prompts."""

    model_config = SECTION_CONFIG

    path: Optional[str] = Field(None, description="null = built-in prompts; else .jsonl / "
                                                  ".json / .parquet")
    prompt_key: str = Field("prompt", min_length=1, description="plain-text prompt field")
    messages_key: str = Field("messages", min_length=1, description="chat field, [{role, "
                              "content}, ...]; wins over prompt_key when present")
    max_prompt_length: Int = Field(64, ge=1, description="tokens after the chat template")
    truncation: Literal["left", "drop", "error"] = Field(
        "left", description="longer prompts: left (keep the end) | drop (skip) | error")
    chat_template: StrictBool = Field(False, description="also wrap plain prompts in the "
                                                        "tokenizer's chat template")
    batch_size: Int = Field(8, ge=1, description="prompts per step (all data-parallel ranks "
                                                 "together)")
    shuffle: StrictBool = Field(True, description="reshuffle the prompts every epoch")
    seed: Int = Field(0, description="seed of the shuffling")
    task: Optional[Literal["find_digit", "last_digit", "max_digit", "add_mod10"]] = Field(
        None, description="a built-in verifiable task instead of path (its held-out split is "
                          "the validation set; reward: parallel_models.rl.data.tasks.first_number_match)")
    val_path: Optional[str] = Field(None, description="validation prompts (.jsonl / .json / "
                                                      ".parquet); null = none, or data.task's")
    val_batch_size: Optional[Int] = Field(None, ge=1, description="validation prompts per "
                                                                 "rollout; null = batch_size")
    max_new_tokens_key: Optional[str] = Field(
        None, min_length=1, description="record field capping that prompt's response tokens "
                                        "(an int in 1..rollout.max_new_tokens); null = "
                                        "rollout.max_new_tokens for every prompt")


class RolloutSection(SamplingFields, AsyncRolloutFields):
    """Generation of the responses (the sampling knobs are those of SamplingParams; the
    async ones, max_staleness etc., in config/async_fields.py)."""

    model_config = SECTION_CONFIG

    backend: str = Field(
        "inprocess", description="inprocess | server (parallel-models-serve at server_url)")
    server_url: Optional[str] = Field(None, description="rollout.backend=server: the server's "
                                                        "base URL")
    weight_push: Literal["stream", "group", "folder"] = Field(
        "stream", description="backend=server: stream (HTTP body) | group (broadcast over a "
                              "process group with the server: gloo, NCCL, or CUDA IPC on one "
                              "GPU) | folder (an HF folder the server loads; also the fallback "
                              "when a stream or group push fails)")
    tensor_parallel_size: Optional[Int] = Field(
        None, ge=1, description="in-process rollout engine's TP (null = the actor's); differs "
                                "from it or PP > 1: weights resharded before each rollout")
    kv_budget_tokens: Union[Literal["auto"], Int] = Field(
        0, description="inprocess: continuous batching with this many KV positions for all "
                       "running samples (rows leave when done, the n samples share one "
                       "prefill); auto = planned from the device memory left at "
                       "gpu_memory_utilization (CPU: every row at once); 0 = static batches; "
                       "trainer.mode=async: the KV pool of the server it starts (0: its default)")
    gpu_memory_utilization: Number = Field(
        0.9, gt=0, le=1, description="continuous batching on CUDA: share of the device the "
                                     "rollout engine may use for weights + KV + activations "
                                     "(vLLM's meaning); sizes the KV pool (kv_budget_tokens="
                                     "auto) and the prefill chunk; a plan that cannot fit is "
                                     "refused before generating")
    max_batch_rows: Int = Field(256, ge=1, description="continuous batching: samples decoding "
                                                       "at once at most")
    dtype: Literal["bf16", "fp8"] = Field("bf16", description="bf16 = decoder linears in model."
                                          "dtype (as before) | fp8 = e4m3 copies (inference/fp8)")
    fp8_scales: Literal["block", "channel"] = Field(
        "channel", description="dtype=fp8: weight scales per out channel (measured faster at "
                               "decode: docs/PERFORMANCE.md, issue 37) | per 128x128 block")
    kv_cache_dtype: Literal["bf16", "fp8"] = Field(
        "bf16", description="continuous engine's KV pool: bf16 = model.dtype (as before) | fp8 "
                            "= e4m3 with fp32 scales per (token, KV head): half the bytes per "
                            "token (backend=server: the server's --kv-cache-dtype decides; "
                            "trainer.mode=async passes it to the server it starts)")
    exact: StrictBool = Field(False, description="batch-invariant kernels (needs Triton): rollout "
                              "log-probs == training log-probs bit for bit (megatron backend, "
                              "inprocess rollout)")
    multi_turn: MultiTurnSection = Field(
        default_factory=MultiTurnSection, description="multi-turn (agentic) rollouts: set "
        "rollout.multi_turn.KEY (rl/config/multi_turn.py)")

    @field_validator("kv_budget_tokens")
    @classmethod
    def _budget_not_negative(cls, value):
        if value != "auto" and value < 0:
            raise ValueError("kv_budget_tokens must be >= 0 or auto")
        return value

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:  # rl/rollout/registry.py
        from parallel_models.rl.rollout.registry import ROLLOUT_BACKENDS

        problem = ROLLOUT_BACKENDS.problem(name)
        if problem:
            raise ValueError(problem)
        return name

    def sampling_params(self, seed: int | None = None) -> SamplingParams:
        """The :class:`SamplingParams` of this section (with ``seed``)."""
        fields = {k: getattr(self, k) for k in SamplingFields.model_fields}
        return SamplingParams(**fields, seed=seed)

    def engine_options(self) -> dict:
        """The in-process rollout engine's batching settings (``RolloutEngine`` keywords), the
        same for the engine on the actor's weights, the hybrid engine's and the fsdp backend's."""
        return {"kv_budget_tokens": self.kv_budget_tokens or None, "max_rows": self.max_batch_rows,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "weight_dtype": self.dtype, "fp8_scales": self.fp8_scales,
                "kv_cache_dtype": self.kv_cache_dtype}


class LoraSection(BaseModel):
    """LoRA adapters (PEFT's names and scaling); rank 0 = off (full fine-tuning)."""

    model_config = SECTION_CONFIG

    rank: Int = Field(0, ge=0, description="adapter rank; 0 = off (full fine-tuning)")
    alpha: Number = Field(16.0, gt=0, description="PEFT's lora_alpha: the scale is alpha / rank")
    dropout: Number = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: Union[str, list[str]] = Field(
        "all-linear", description="all-linear | a list of q_proj, k_proj, v_proj, o_proj, "
                                  "gate_proj, up_proj, down_proj")

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value):
        from parallel_models.lora.config import resolve_targets

        resolve_targets(value)  # a ConfigError (a ValueError) names the unknown module
        return value

    def settings(self):
        """The model-level ``LoraSettings``, None when LoRA is off."""
        if not self.rank:
            return None
        from parallel_models.lora.config import LoraSettings

        return LoraSettings(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                            target_modules=self.target_modules)


class ActorSection(OptimizerFields):
    """The policy and its PPO loss (the optimizer knobs are those of OptimConfig)."""

    model_config = SECTION_CONFIG

    ppo_epochs: Int = Field(2, ge=1, description="passes over each step's samples")
    mini_batch_size: Int = Field(16, ge=1, description="sequences per optimizer step; divides "
                                                      "data.batch_size * rollout.n")
    micro_batch_tokens: Int = Field(2048, ge=1, description="token budget of one forward/"
                                                            "backward microbatch")
    clip_ratio_low: Number = Field(0.2, gt=0, lt=1, description="PPO clip below 1")
    clip_ratio_high: Number = Field(0.2, gt=0, description="PPO clip above 1")
    clip_ratio_c: Number = Field(3.0, gt=1, description="dual-clip bound")
    entropy_coef: Number = Field(0.0, ge=0, description="entropy bonus")
    loss_agg_mode: LossAggMode = Field("token-mean", description="token-mean | token-sum | "
                                       "seq-mean-token-sum | seq-mean-token-mean | "
                                       "seq-mean-token-sum-norm (docs/ALGORITHMS.md)")
    loss_scale_factor: Optional[Int] = Field(None, ge=1, description="seq-mean-token-sum-norm "
                                             "divides by it (Dr. GRPO: the longest response); "
                                             "null = the response mask's width")
    policy_loss: str = Field("vanilla", min_length=1, description="vanilla (clipped, dual "
                             "clip; alias ppo) | gspo | geo_mean | cispo | clip_cov | kl_cov | "
                             "gpg | path/to/file.py:function (signature: rl/algorithms/"
                             "losses.py)")
    clip_cov_ratio: Number = Field(0.0002, gt=0, le=1, description="clip_cov: share of tokens "
                                   "whose gradient is detached")
    clip_cov_lb: Number = Field(1.0, description="clip_cov: lower bound of the covariance "
                                "of the tokens it may detach")
    clip_cov_ub: Number = Field(5.0, description="clip_cov: upper bound of that covariance")
    kl_cov_ratio: Number = Field(0.0002, gt=0, le=1, description="kl_cov: share of tokens "
                                 "(largest covariance) that get the KL penalty")
    ppo_kl_coef: Number = Field(0.1, ge=0, description="kl_cov: weight of the |log ratio| "
                                "penalty")
    use_kl_loss: StrictBool = Field(False, description="KL to the reference as a loss term "
                                                       "(GRPO style)")
    kl_loss_coef: Number = Field(0.001, ge=0, description="weight of the KL loss")
    kl_loss_type: str = Field("low_var_kl", min_length=1, description="KL estimator: k1 | abs "
                              "| k2 | mse | k3 | low_var_kl | path/to/file.py:function")
    router_replay: Literal["off", "R2", "R3"] = Field(
        "off", description="MoE only: off | R2 (updates replay the old-log-prob forward's "
                           "expert choice) | R3 (old-log-prob and updates replay the rollout's)")
    router_replay_reference: StrictBool = Field(False, description="the reference forward "
                                                "replays the same routes (needs router_replay)")
    moe_aux_loss_coef: Optional[Number] = Field(None, ge=0, description="MoE: weight of the "
                                                "load-balancing loss (transformers' aux_loss); "
                                                "null = the model's router_aux_loss_coef, 0 = off")
    tis_cap: Optional[Number] = Field(None, gt=0, description="truncated importance sampling: "
                                      "policy loss x min(exp(old - rollout log-prob), cap); "
                                      "null = off (= rollout_correction level token, mode "
                                      "truncate, hi cap)")
    rollout_correction: RolloutCorrectionFields = Field(
        default_factory=RolloutCorrectionFields, description="training-inference mismatch: "
        "level (token | sequence | geometric), mode (truncate | mask), hi, lo, reject "
        "(seq_{sum,mean,max}_k{2,3}), reject_threshold")
    recompute: Recompute = Field("none", description=RECOMPUTE_HELP + "; the reference runs "
                                 "no backward: nothing to recompute")
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA adapters "
                              "(fsdp: through peft): actor.lora.rank=8 trains only them")

    @model_validator(mode="after")
    def _clip_cov_bounds(self):
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"actor.clip_cov_lb ({self.clip_cov_lb}) must be below "
                             f"actor.clip_cov_ub ({self.clip_cov_ub})")
        return self


class CriticSection(OptimizerFields):
    """The value model (the optimizer knobs are those of OptimConfig)."""

    model_config = SECTION_CONFIG

    enable: Optional[StrictBool] = Field(None, description="null = when the advantage "
                                         "estimator needs one (gae); true / false must agree "
                                         "with it")
    path: Optional[str] = Field(None, description="null = initialize from the actor with a new "
                                                  "value head")
    cliprange_value: Number = Field(0.5, gt=0, description="value clipping")
    recompute: Recompute = Field("none", description=RECOMPUTE_HELP)
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA adapters: "
                              "critic.lora.rank=8 trains them and the value head (PEFT's "
                              "SEQ_CLS modules_to_save)")


class RewardSection(BaseModel):
    """The reward: a rule (a Python function) or a value-head reward model."""

    model_config = SECTION_CONFIG

    type: Literal["rule", "model"] = Field("rule", description="rule | model")
    function: Optional[str] = Field(
        None, description="type=rule: a built-in (vowel_reward | length_reward | exact_match | "
                          "math_reward), package.module.function or path/to/file.py:function: "
                          "fn(prompts, responses, **record_fields), or verl's "
                          "compute_score(data_source, solution_str, ground_truth, extra_info); "
                          "null = tasks.first_number_match with data.task, else vowel_reward")
    model_path: Optional[str] = Field(None, description="type=model: HF sequence-"
                                                        "classification folder")
    tokenizer: Optional[str] = Field(None, description="null = the reward model's own")
    tensor_parallel_size: Optional[Int] = Field(
        None, ge=1, description="null = the actor's (the reward model shares its groups for "
                                "now)")
    pipeline_parallel_size: Optional[Int] = Field(None, ge=1, description="null = the actor's")
    offload: StrictBool = Field(False, description="weights on the host between score calls "
                                                   "(CUDA only)")
    max_length: Optional[Int] = Field(None, ge=1, description="null = min("
                                      "max_position_embeddings, tokenizer's model_max_length)")
    truncation: Literal["left", "right"] = Field("left", description="over max_length: left "
                                                 "drops the start, right the end")
    micro_batch_tokens: Int = Field(4096, ge=1, description="token budget of one forward")
    layers_per_stage: Optional[list[Int]] = Field(
        None, description="layers per pipeline stage, e.g. [3, 2] (null = an even split)")
    same_tokenizer: Optional[StrictBool] = Field(
        None, description="null = detect; true = score the actor's ids as they are")
    overlong_buffer: OverlongBufferFields = Field(
        default_factory=OverlongBufferFields, description="DAPO overlong shaping: enable, len "
        "(buffer tokens before rollout.max_new_tokens), penalty_factor")


class AlgorithmSection(BaseModel):
    """Advantages and the KL penalty."""

    model_config = SECTION_CONFIG

    adv_estimator: str = Field("gae", min_length=1, description="gae | grpo | rloo | "
                               "reinforce_plus_plus | reinforce_plus_plus_baseline | remax | "
                               "opo | gpg | path/to/file.py:function (signature: "
                               "rl/algorithms/estimators.py)")
    gamma: Number = Field(1.0, ge=0, le=1, description="discount")
    lam: Number = Field(0.95, ge=0, le=1, description="GAE lambda")
    kl_penalty: str = Field("k1", min_length=1, description="in-reward KL estimator: k1 | abs "
                            "| k2 | mse | k3 | low_var_kl | path/to/file.py:function")
    kl_in_reward: StrictBool = Field(True, description="subtract kl_coef * KL from the reward")
    kl_coef: Number = Field(0.001, ge=0, description="in-reward KL coefficient (start value "
                                                     "when adaptive)")
    kl_ctrl: Literal["fixed", "adaptive"] = Field("fixed", description="fixed | adaptive")
    kl_target: Number = Field(0.1, gt=0, description="adaptive: target KL per token (responses' "
                                                     "token-mean KL, averaged; verl)")
    kl_horizon: Int = Field(10000, gt=0, description="adaptive controller: horizon")
    dynamic_sampling: StrictBool = Field(False, description="DAPO: drop groups whose rewards "
                                         "all agree and draw more prompt batches until "
                                         "data.batch_size groups are kept")
    max_gen_batches: Int = Field(10, ge=0, description="dynamic_sampling: prompt batches drawn "
                                 "per step at most (then the run stops); 0 = no limit")
    norm_adv_by_std: StrictBool = Field(True, description="grpo: divide by the group's std; "
                                        "false = Dr. GRPO (with actor.loss_agg_mode "
                                        "seq-mean-token-sum-norm)")
    whiten_advantages: Optional[StrictBool] = Field(
        None, description="whiten the final advantages over the global batch; null = the "
                          "estimator's default (gae: true, grpo / rloo: false, as verl; a "
                          "user's: false unless it sets whiten_by_default)")


class TrainerSection(BaseModel):
    """The run: steps, seeds, outputs."""

    model_config = SECTION_CONFIG

    total_steps: Int = Field(20, ge=0, description="PPO steps")
    mode: Literal["sync", "async"] = Field("sync", description="sync (rollout, then update) | "
                                           "async (a rollout server fills a queue while the "
                                           "trainer trains; rollout.max_staleness)")
    seed: Int = Field(0, description="seeds sampling (each sample drawn from (seed, step, "
                      "prompt index, sample index): the same at any layout), value-head init and "
                      "data order")
    output_dir: str = Field("outputs/ppo", min_length=1, description="metrics, checkpoints, "
                                                                     "final models")
    log_every: Int = Field(1, ge=1, description="a metrics line in the log every N steps (the "
                                                "loggers get every step)")
    save_every: Int = Field(10, ge=0, description="checkpoint every N steps (and at the last "
                                                  "step); 0 = never")
    max_checkpoints: Optional[Int] = Field(None, ge=1, description="keep the newest K "
                                                                  "checkpoints; null = all")
    resume: StrictBool = Field(False, description="continue from the latest checkpoint "
                                                  "(the CLI's --resume)")
    resume_fallback: StrictBool = Field(
        False, description="when the latest checkpoint cannot be resumed, resume the newest "
                           "usable older one (with a warning) instead of stopping")
    offload: StrictBool = Field(False, description="CUDA only: idle models / optimizer states "
                                                   "to CPU")
    release_idle_grads: Optional[StrictBool] = Field(
        None, description="megatron backend without trainer.offload: the trainable roles' "
                          "gradient buffers are freed outside their update phases and come "
                          "back zeroed (4 bytes a parameter for the rollout's KV pool); "
                          "null = on CUDA")
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        ["jsonl", "tensorboard"], description="where metrics go: jsonl | tensorboard | wandb | "
                                              "mlflow (the last two: pip install -e "
                                              "'.[trackers]' in a clone)")
    project_name: str = Field("parallel-models", min_length=1, description="wandb project / "
                                                                          "mlflow experiment")
    experiment_name: Optional[str] = Field(None, description="run name in the trackers; null = "
                                                            "theirs")
    test_freq: Int = Field(0, ge=0, description="validate every N steps (and at the last "
                                                "step); 0 = never")
    val_before_train: StrictBool = Field(True, description="validate before the first step "
                                                           "(when there is a validation set)")
    val_greedy: StrictBool = Field(True, description="greedy validation rollouts (else "
                                                     "rollout's sampling, one sample)")
    val_samples_logged: Int = Field(4, ge=0, description="sample generations logged per "
                                                         "validation")
    save_hf_at_end: StrictBool = Field(True, description="actor_hf/ and critic_hf/ at the end")


DEFAULT_REWARD = "parallel_models.rl.rewards.rules.vowel_reward"
TASK_REWARD = "parallel_models.rl.data.tasks.first_number_match"


def reward_function_path(cfg) -> str:
    """``reward.function``, or the default for the data (a built-in task's own scorer)."""
    if cfg.reward.function:
        return cfg.reward.function
    return TASK_REWARD if cfg.data.task else DEFAULT_REWARD


SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelSection,
    "parallel": ParallelSection,
    "data": DataSection,
    "rollout": RolloutSection,
    "actor": ActorSection,
    "critic": CriticSection,
    "reward": RewardSection,
    "algorithm": AlgorithmSection,
    "trainer": TrainerSection,
    "kernels": KernelOptions,  # parallel_models.options: set process-wide by rl.train
}

# defaults of the PPO run that differ from the shared models' own
SECTION_DEFAULTS: dict[str, dict] = {
    "rollout": {"n": 4},
    "actor": {"lr": 1e-3},
    "critic": {"lr": 1e-3},
}
