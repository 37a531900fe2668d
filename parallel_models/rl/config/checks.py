"""Cross-field checks of the PPO config: what no single field can say (batch sizes that must
divide each other, the layout vs the world size and the model's heads, files that must exist,
options that need one another). :func:`cross_field_problems` returns every problem as a line
naming the keys involved; ``PPOConfig``'s model validator raises them together.
"""

from __future__ import annotations

import logging
import os

from parallel_models.errors import ConfigError
from parallel_models.rl.backends.builtin_model import BUILTIN_MOE, builtin_model_config
from parallel_models.rl.config.async_fields import async_problems
from parallel_models.rl.config.fp8_rollout import fp8_rollout_problems
from parallel_models.rl.config.sections import DATA_SUFFIXES

logger = logging.getLogger(__name__)


def _is_local(path: str) -> bool:
    return os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)


def _model_problems(cfg) -> list[str]:
    m, par, r = cfg.model, cfg.parallel, cfg.rollout
    errors = []
    if m.path is not None and _is_local(m.path) and not os.path.isdir(os.path.expanduser(m.path)):
        errors.append(f"model.path: {m.path!r} is not a directory (an HF model folder)")
    if par.backend == "fsdp":
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(par, key) != 1:
                errors.append(f"parallel.{key}={getattr(par, key)}: parallel.backend=fsdp "
                              "shards over data-parallel ranks only; set it to 1")
        if r.backend != "inprocess":
            errors.append("rollout.backend=server: parallel.backend=fsdp generates in-process "
                          "(set rollout.backend=inprocess)")
        if (r.tensor_parallel_size or 1) != 1:
            errors.append(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: "
                          "parallel.backend=fsdp generates at TP=1 on every rank; set it to 1")
    if m.path is not None and os.path.isfile(os.path.join(os.path.expanduser(m.path),
                                                          "config.json")):
        from parallel_models.config import ModelConfig

        for key, tp in (("parallel.tensor_parallel_size", par.tensor_parallel_size),
                        ("rollout.tensor_parallel_size", r.tensor_parallel_size or 1)):
            if tp == 1:
                continue
            try:
                ModelConfig.from_hf(os.path.expanduser(m.path)).check_tensor_parallel(tp)
            except ConfigError as err:
                errors.append(f"{key}: {m.path}: {err}")
    if cfg.actor.lora.rank and r.backend == "server" and r.weight_push != "stream":
        errors.append(f"rollout.weight_push={r.weight_push}: a LoRA actor (actor.lora.rank="
                      f"{cfg.actor.lora.rank}) streams its adapters to the server; set "
                      "rollout.weight_push=stream")
    if (r.backend == "server" or cfg.trainer.mode == "async") and not r.ignore_eos and \
            len(r.stop_token_ids) > 63:
        errors.append(f"rollout.stop_token_ids: {len(r.stop_token_ids)} ids; a rollout server "
                      "request carries the EOS among its at most 64 stop ids: give at most 63 "
                      "(fewer if the tokenizer has several EOS ids)")
    errors += _router_replay_problems(cfg)
    errors += _expert_parallel_problems(cfg)
    errors += _context_parallel_problems(cfg)
    return errors


def _context_parallel_problems(cfg) -> list[str]:
    """parallel.context_parallel_size > 1 runs the megatron backend's training and scoring
    forwards (not exact mode's attention kernel)."""
    par = cfg.parallel
    cp = par.context_parallel_size
    if cp == 1:
        return []
    key = f"parallel.context_parallel_size={cp}"
    errors = []
    if par.backend != "megatron":
        errors.append(f"{key}: context parallelism needs parallel.backend=megatron")
    if cfg.rollout.exact:
        errors.append(f"{key}: rollout.exact=true scores with the rollout's batch-invariant "
                      "attention kernel, which does not split sequences; set one of them off")
    return errors


def _expert_parallel_problems(cfg) -> list[str]:
    """parallel.expert_parallel_size > 1 needs the megatron backend and an MoE model whose
    expert count it divides."""
    ep, m = cfg.parallel.expert_parallel_size, cfg.model
    if ep == 1:
        return []
    key = f"parallel.expert_parallel_size={ep}"
    if cfg.parallel.backend != "megatron":
        return [f"{key}: expert parallel runs in the megatron backend; set "
                "parallel.backend=megatron"]
    if m.path is None:
        return [f"{key}: the built-in model (model.path=null) is a dense Llama; use "
                "model.path=builtin-moe or an MoE model, or expert_parallel_size=1"]
    if m.path == BUILTIN_MOE:
        experts = builtin_model_config(1, moe=True).num_experts
    else:
        config_file = os.path.join(os.path.expanduser(m.path), "config.json")
        if not os.path.isfile(config_file):
            return []  # a hub name: checked when the trainer loads the model
        from parallel_models.config import ModelConfig

        try:
            experts = ModelConfig.from_hf(os.path.expanduser(m.path)).num_experts or 0
        except ConfigError:  # an unsupported config: reported by the model checks
            return []
    if not experts:
        return [f"{key}: {m.path} is a dense model (no experts to split); use "
                "expert_parallel_size=1"]
    if experts % ep:
        return [f"{key} does not divide the model's num_experts ({experts})"]
    return []


def _router_replay_problems(cfg) -> list[str]:
    """R2 / R3 need an MoE actor: refused for a dense one (there is nothing to replay, and a
    silent no-op would hide a wrong model path)."""
    a, m = cfg.actor, cfg.model
    errors = []
    if a.router_replay_reference and a.router_replay == "off":
        errors.append("actor.router_replay_reference=true needs actor.router_replay R2 or R3")
    if a.router_replay == "off":
        return errors
    if cfg.parallel.backend != "megatron":
        return errors + [f"actor.router_replay={a.router_replay}: router replay runs in the "
                         "megatron backend (MoE layers); set parallel.backend=megatron"]
    if m.path is None:
        return errors + [f"actor.router_replay={a.router_replay}: the built-in model "
                         "(model.path=null) is a dense Llama; use model.path=builtin-moe or an "
                         "MoE model, or router_replay=off"]
    config_file = os.path.join(os.path.expanduser(m.path), "config.json")
    if m.path != BUILTIN_MOE and os.path.isfile(config_file):
        from parallel_models.config import ModelConfig

        try:
            dense = not ModelConfig.from_hf(os.path.expanduser(m.path)).is_moe
        except ConfigError:  # an unsupported config: reported by the model checks
            dense = False
        if dense:
            errors.append(f"actor.router_replay={a.router_replay}: {m.path} is a dense model "
                          "(no MoE layer to replay); use router_replay=off")
    return errors


def _data_and_batch_problems(cfg) -> list[str]:
    d, r, a = cfg.data, cfg.rollout, cfg.actor
    errors = []
    for key in ("path", "val_path"):
        path = getattr(d, key)
        if path is None:
            continue
        if not os.path.isfile(path):
            errors.append(f"data.{key}: prompt file not found: {path!r}")
        elif not path.endswith(DATA_SUFFIXES):
            errors.append(f"data.{key}: {path!r} has an unsupported extension; use one of "
                          f"{', '.join(DATA_SUFFIXES)}")
    if d.path is not None and d.task is not None:
        errors.append(f"data.path ({d.path!r}) and data.task ({d.task!r}) both give the training "
                      "prompts: set one")
    if cfg.trainer.test_freq and d.val_path is None and d.task is None:
        errors.append(f"trainer.test_freq={cfg.trainer.test_freq} needs a validation set: "
                      "data.val_path or data.task")
    if r.exact and (r.backend != "inprocess" or cfg.parallel.backend != "megatron"):
        errors.append("rollout.exact=true runs the batch-invariant kernels of our own layers: "
                      "it needs rollout.backend=inprocess and parallel.backend=megatron")
    rollout_tp = r.tensor_parallel_size or cfg.parallel.tensor_parallel_size
    if r.exact and rollout_tp != cfg.parallel.tensor_parallel_size:
        errors.append(f"rollout.exact=true with rollout.tensor_parallel_size={rollout_tp} != "
                      f"parallel.tensor_parallel_size={cfg.parallel.tensor_parallel_size}: the "
                      "row-parallel sums differ between TP sizes; use the actor's TP")
    if r.backend == "server" and not r.server_url:
        errors.append("rollout.backend=server needs rollout.server_url")
    if d.max_new_tokens_key and cfg.trainer.mode != "async" and (
            r.backend != "inprocess" or cfg.parallel.backend != "megatron"):
        errors.append(f"data.max_new_tokens_key={d.max_new_tokens_key!r} (per-prompt response "
                      "caps) is read by the in-process rollout of the megatron backend (or an "
                      "async run's server): it needs rollout.backend=inprocess and "
                      "parallel.backend=megatron, or trainer.mode=async")
    samples = d.batch_size * r.n
    if samples % a.mini_batch_size:
        errors.append(f"data.batch_size * rollout.n = {d.batch_size} * {r.n} = {samples} "
                      f"sequences per step is not divisible by actor.mini_batch_size "
                      f"({a.mini_batch_size})")
    longest = d.max_prompt_length + r.max_new_tokens
    if a.micro_batch_tokens < longest:
        errors.append(f"actor.micro_batch_tokens ({a.micro_batch_tokens}) is smaller than the "
                      f"longest sequence, data.max_prompt_length + rollout.max_new_tokens = "
                      f"{longest}")
    return errors


def _extension_problems(cfg) -> list[str]:
    """The names of what users extend, resolved against their registries (a user's file is
    loaded here, once per process), and the critic / estimator agreement."""
    from parallel_models.rl.algorithms.core import KL_ESTIMATORS
    from parallel_models.rl.algorithms.estimators import ADVANTAGE_ESTIMATORS
    from parallel_models.rl.algorithms.losses import POLICY_LOSSES

    alg, c = cfg.algorithm, cfg.critic
    errors = []
    for key, registry in (("algorithm.adv_estimator", ADVANTAGE_ESTIMATORS),
                          ("actor.policy_loss", POLICY_LOSSES),
                          ("algorithm.kl_penalty", KL_ESTIMATORS),
                          ("actor.kl_loss_type", KL_ESTIMATORS)):
        try:
            registry.get(cfg.get(key))
        except ConfigError as err:
            errors.append(f"{key}: {err}")
    try:
        estimator = ADVANTAGE_ESTIMATORS.get(alg.adv_estimator)
    except ConfigError:
        return errors
    name = alg.adv_estimator
    if ADVANTAGE_ESTIMATORS.attribute(estimator, "needs_critic"):
        if c.enable is False:
            errors.append(f"algorithm.adv_estimator={name} needs a critic: set critic.enable="
                          "true or leave it unset (or use adv_estimator=grpo / rloo)")
    elif c.enable:
        errors.append(f"critic.enable=true but algorithm.adv_estimator={name} uses no critic "
                      "(it declares needs_critic=False): leave critic.enable unset or use an "
                      "estimator that needs one (gae)")
    if ADVANTAGE_ESTIMATORS.attribute(estimator, "needs_groups") and cfg.rollout.n < 2:
        errors.append(f"algorithm.adv_estimator={name} compares the samples of a prompt: it "
                      f"needs rollout.n >= 2, got {cfg.rollout.n}")
    return errors


def _roles_problems(cfg) -> list[str]:
    c, rw, alg, par = cfg.critic, cfg.reward, cfg.algorithm, cfg.parallel
    errors = _extension_problems(cfg)
    if c.path is not None and (os.path.isabs(c.path) or c.path.startswith((".", "~"))) and \
            not os.path.exists(os.path.expanduser(c.path)):
        errors.append(f"critic.path: {c.path!r} does not exist")
    if rw.type == "rule":
        from parallel_models.rl.config.sections import reward_function_path
        from parallel_models.rl.rewards.rules import load_reward_function

        try:
            load_reward_function(reward_function_path(cfg))
        except ConfigError as err:
            errors.append(f"reward.function: {err}")
    elif not rw.model_path:
        errors.append("reward.type=model needs reward.model_path (an HF sequence-classification "
                      "folder)")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(rw, key)
        if value is not None and value != getattr(par, key):
            errors.append(f"reward.{key}={value}: in this version the reward model shares the "
                          f"actor's model-parallel groups, so it must equal parallel.{key} "
                          f"({getattr(par, key)}) or be left unset")
    errors += _dapo_problems(cfg)
    if alg.kl_ctrl == "adaptive" and not alg.kl_in_reward:
        errors.append("algorithm.kl_ctrl=adaptive adjusts the in-reward KL coefficient: it "
                      "needs algorithm.kl_in_reward=true")
    return errors


def _dapo_problems(cfg) -> list[str]:
    """Dynamic sampling, overlong shaping and rollout correction against the rest."""
    errors = []
    if cfg.algorithm.dynamic_sampling and cfg.rollout.n < 2:
        errors.append("algorithm.dynamic_sampling drops prompts whose samples' rewards all "
                      f"agree: it needs rollout.n >= 2, got {cfg.rollout.n}")
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len > cfg.rollout.max_new_tokens:
        errors.append(f"reward.overlong_buffer.len ({ob.len}) must be <= rollout.max_new_tokens "
                      f"({cfg.rollout.max_new_tokens})")
    rc = cfg.actor.rollout_correction
    if cfg.actor.tis_cap is not None and (rc.level is not None or rc.reject is not None):
        errors.append("actor.tis_cap and actor.rollout_correction both correct the rollout "
                      "mismatch: set one (tis_cap=C is rollout_correction level=token, "
                      "mode=truncate, hi=C)")
    return errors


def _layout_problems(cfg, world_size: int) -> list[str]:
    par, d, a = cfg.parallel, cfg.data, cfg.actor
    model_par = par.tensor_parallel_size * par.pipeline_parallel_size
    if world_size % model_par:
        return [f"world size {world_size} is not divisible by tensor_parallel_size * "
                f"pipeline_parallel_size = {model_par}"]
    if world_size % (model_par * par.context_parallel_size):
        return [f"world size {world_size} is not divisible by tensor_parallel_size * "
                f"pipeline_parallel_size * context_parallel_size = "
                f"{model_par * par.context_parallel_size}"]
    expert_par = model_par * par.expert_parallel_size  # the experts' TP x EP x PP grid
    if world_size % expert_par:
        return [f"world size {world_size} is not divisible by tensor_parallel_size * "
                f"pipeline_parallel_size * expert_parallel_size = {expert_par} (experts are "
                "split over EP inside the data-parallel group)"]
    dp = world_size // (model_par * par.context_parallel_size)
    model_par *= par.context_parallel_size  # for the messages below
    errors = []
    rollout_tp = cfg.rollout.tensor_parallel_size
    if rollout_tp is not None and world_size % rollout_tp:
        errors.append(f"rollout.tensor_parallel_size ({rollout_tp}) does not divide the world "
                      f"size ({world_size}): the rollout engine's TP groups cover every rank")
    if d.batch_size % dp:
        errors.append(f"data.batch_size ({d.batch_size}) is not divisible by the data-parallel "
                      f"size ({dp} = world size {world_size} / {model_par})")
    if a.mini_batch_size % dp:
        errors.append(f"actor.mini_batch_size ({a.mini_batch_size}) is not divisible by the "
                      f"data-parallel size ({dp})")
    return errors


def cross_field_problems(cfg, world_size: int | None = None) -> list[str]:
    """Every cross-field problem of ``cfg`` (a type-checked PPOConfig). ``world_size`` (default
    ``$WORLD_SIZE`` or 1) is checked against the model-parallel layout and the batch sizes."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if (cfg.trainer.offload or cfg.reward.offload):
        import torch

        if not torch.cuda.is_available():
            logger.warning("trainer.offload / reward.offload only act on CUDA; ignored here")
    return (_model_problems(cfg) + _data_and_batch_problems(cfg) + _roles_problems(cfg)
            + _layout_problems(cfg, world_size) + fp8_rollout_problems(cfg)
            + async_problems(cfg))

