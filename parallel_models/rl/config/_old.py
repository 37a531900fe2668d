"""PPO configuration: typed dataclass sections, loaded from YAML, overridden with ``key=value``.

    cfg = load_config("ppo.yaml", ["actor.lr=1e-5", "trainer.total_steps=20"])
    cfg = load_config(None, [])            # the built-in default run (tiny Llama, CPU)

Values of overrides are parsed with ``yaml.safe_load`` (``rollout.stop_token_ids=[2, 13]``,
``model.path=null``). Every key is checked against the dataclass fields: an unknown key or a value
of the wrong type raises :class:`parallel_models.config.ConfigError` naming the key (and, for an
unknown key, the valid keys of its section). ``PPOConfig.validate()`` then checks the values
together (divisibility of batch sizes, ranges, files that must exist) and reports every problem
at once.

The defaults are those of the built-in tiny CPU run; ``configs/default.yaml`` (package data)
mirrors them and is the starting point for a config file of one's own.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import logging
import os
import types
import typing
from typing import Any, Literal

import yaml

from parallel_models.config import ConfigError

logger = logging.getLogger(__name__)

KL_KINDS = ("k1", "abs", "k2", "mse", "k3", "low_var_kl")
KLKind = Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


# ---- sections ----------------------------------------------------------------------------------
@dataclasses.dataclass
class ModelSection:
    path: str | None = None          # HF folder of the actor; None = build the built-in tiny Llama
    dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = "float32"
    tokenizer: str | None = None     # None = the tokenizer in `path` (or the built-in one)


@dataclasses.dataclass
class ParallelSection:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False


@dataclasses.dataclass
class DataSection:
    path: str | None = None          # None = built-in prompts; else .jsonl / .json / .parquet
    prompt_key: str = "prompt"       # plain-text prompt field
    messages_key: str = "messages"   # chat field: list of {role, content}; wins over prompt_key
    max_prompt_length: int = 64      # tokens, after the chat template
    truncation: Literal["left", "drop", "error"] = "left"  # what to do with longer prompts
    chat_template: bool = False      # also wrap plain prompts in the tokenizer's chat template
    batch_size: int = 8              # prompts per PPO step (all data-parallel ranks together)
    shuffle: bool = True
    seed: int = 0


@dataclasses.dataclass
class RolloutSection:
    backend: Literal["inprocess", "server"] = "inprocess"
    server_url: str | None = None
    n: int = 4                       # samples per prompt
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0                   # 0 = off
    top_p: float = 1.0               # 1.0 = off
    greedy: bool = False
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # besides EOS


@dataclasses.dataclass
class ActorSection:
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_grad: float = 1.0           # max grad norm; 0 = no clipping
    warmup_steps: int = 0
    ppo_epochs: int = 2
    mini_batch_size: int = 16        # sequences per optimizer step (all DP ranks together)
    micro_batch_tokens: int = 2048   # token budget of one forward/backward microbatch
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0        # dual-clip bound (> 1)
    entropy_coef: float = 0.0
    loss_agg_mode: LossAggMode = "token-mean"
    use_kl_loss: bool = False        # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001
    kl_loss_type: KLKind = "low_var_kl"


@dataclasses.dataclass
class CriticSection:
    enable: bool = True              # needed by adv_estimator=gae; unused by grpo / rloo
    path: str | None = None          # None = initialize from the actor (new value head)
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    cliprange_value: float = 0.5
    warmup_steps: int = 0


@dataclasses.dataclass
class RewardSection:
    type: Literal["rule", "model"] = "rule"
    function: str = "parallel_models.rl.rewards.vowel_reward"  # for type=rule
    model_path: str | None = None    # for type=model: an HF sequence-classification folder
    tokenizer: str | None = None     # None = the reward model's own tokenizer
    # the reward model shares the actor's model-parallel groups for now: None = the actor's;
    # any other value must equal it (RewardModel raises a ConfigError otherwise)
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    offload: bool = False            # weights on the host between score calls (CUDA)
    max_length: int | None = None    # RM tokens; None = min(max_position_embeddings, tokenizer's)
    truncation: Literal["left", "right"] = "left"  # over max_length: drop the start / the end
    micro_batch_tokens: int = 4096


@dataclasses.dataclass
class AlgorithmSection:
    adv_estimator: Literal["gae", "grpo", "rloo"] = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    kl_penalty: KLKind = "k1"        # estimator of the in-reward KL penalty
    kl_in_reward: bool = True
    kl_coef: float = 0.001
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_target: float = 0.1           # adaptive controller
    kl_horizon: int = 10000          # adaptive controller
    whiten_advantages: bool = True


@dataclasses.dataclass
class TrainerSection:
    total_steps: int = 20
    seed: int = 0
    output_dir: str = "outputs/ppo"
    log_every: int = 1
    save_every: int = 10             # checkpoint every N steps; 0 = never
    resume: bool = False
    offload: bool = False            # CUDA only: idle models / optimizer states to CPU
    tensorboard: bool = True
    save_hf_at_end: bool = True


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "parallel": ParallelSection,
    "data": DataSection,
    "rollout": RolloutSection,
    "actor": ActorSection,
    "critic": CriticSection,
    "reward": RewardSection,
    "algorithm": AlgorithmSection,
    "trainer": TrainerSection,
}


@dataclasses.dataclass
class PPOConfig:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    parallel: ParallelSection = dataclasses.field(default_factory=ParallelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    actor: ActorSection = dataclasses.field(default_factory=ActorSection)
    critic: CriticSection = dataclasses.field(default_factory=CriticSection)
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)

    # ---- conversion ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def save(self, path: str | os.PathLike) -> str:
        """Write the config as YAML (atomically: temp file + rename); returns the path."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_yaml())
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, data: dict | None, source: str = "config") -> "PPOConfig":
        cfg = cls()
        cfg.update(data or {}, source=source)
        return cfg

    def update(self, data: dict, source: str = "config") -> "PPOConfig":
        """Merge a nested ``{section: {key: value}}`` mapping (type-checked, unknown keys raise)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections "
                              f"({', '.join(SECTIONS)}), got {type(data).__name__}")
        for section, values in data.items():
            _section_class(section, source)
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: section {section!r} must be a mapping of "
                                  f"key: value, got {values!r}")
            for key, value in values.items():
                self.set(f"{section}.{key}", value, source=source)
        return self

    def set(self, dotted: str, value: Any, source: str = "override") -> None:
        """Set ``section.key`` to ``value`` after checking the key and the value's type."""
        parts = str(dotted).split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"{source}: {dotted!r} is not a 'section.key' name; sections: "
                              f"{', '.join(SECTIONS)}")
        section, key = parts
        klass = _section_class(section, source)
        hints = _hints(klass)
        if key not in hints:
            raise ConfigError(_unknown(f"{section}.{key}", key, list(hints), f"section {section!r}",
                                       source))
        setattr(getattr(self, section), key, _coerce(value, hints[key], dotted))

    def get(self, dotted: str) -> Any:
        section, key = dotted.split(".")
        return getattr(getattr(self, section), key)

    # ---- checks ----------------------------------------------------------------------------------
    def check_types(self) -> None:
        """Re-check every field's type (catches values assigned in code)."""
        for section, klass in SECTIONS.items():
            obj = getattr(self, section)
            if not isinstance(obj, klass):
                raise ConfigError(f"{section} must be a {klass.__name__}, got {type(obj).__name__}")
            for key, hint in _hints(klass).items():
                setattr(obj, key, _coerce(getattr(obj, key), hint, f"{section}.{key}"))

    def validate(self, world_size: int | None = None) -> "PPOConfig":
        """Check the values together; raise one ConfigError listing every problem.

        ``world_size`` (default: ``$WORLD_SIZE`` or 1) is used to check that the data-parallel
        size divides the batch sizes.
        """
        self.check_types()
        errors: list[str] = []

        def need(cond: bool, msg: str) -> None:
            if not cond:
                errors.append(msg)

        m, par, d, r = self.model, self.parallel, self.data, self.rollout
        a, c, rw, alg, t = self.actor, self.critic, self.reward, self.algorithm, self.trainer

        # model / parallel
        if m.path is not None:
            local = os.path.isabs(m.path) or m.path.startswith((".", "~")) or os.path.exists(m.path)
            if local and not os.path.isdir(os.path.expanduser(m.path)):
                errors.append(f"model.path: {m.path!r} is not a directory (an HF model folder)")
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            need(getattr(par, key) >= 1, f"parallel.{key} must be >= 1, got {getattr(par, key)}")
        if par.pipeline_parallel_size > 1 and r.backend == "inprocess":
            errors.append(f"parallel.pipeline_parallel_size={par.pipeline_parallel_size}: "
                          "in-process rollout generation needs pipeline_parallel_size=1 "
                          "(use tensor/data parallelism, or rollout.backend=server)")
        if m.path is not None and par.tensor_parallel_size > 1 and \
                os.path.isfile(os.path.join(os.path.expanduser(m.path), "config.json")):
            try:
                from parallel_models.config import ModelConfig

                ModelConfig.from_hf(os.path.expanduser(m.path)).check_tensor_parallel(
                    par.tensor_parallel_size)
            except ConfigError as err:
                errors.append(f"parallel.tensor_parallel_size: {m.path}: {err}")

        # data
        if d.path is not None:
            if not os.path.isfile(d.path):
                errors.append(f"data.path: prompt file not found: {d.path!r}")
            elif not d.path.endswith(DATA_SUFFIXES):
                errors.append(f"data.path: {d.path!r} has an unsupported extension; use one of "
                              f"{', '.join(DATA_SUFFIXES)}")
        need(d.max_prompt_length >= 1, f"data.max_prompt_length must be >= 1, got "
                                       f"{d.max_prompt_length}")
        need(d.batch_size >= 1, f"data.batch_size must be >= 1, got {d.batch_size}")
        need(bool(d.prompt_key), "data.prompt_key must not be empty")
        need(bool(d.messages_key), "data.messages_key must not be empty")

        # rollout
        if r.backend == "server":
            need(bool(r.server_url), "rollout.backend=server needs rollout.server_url")
        need(r.n >= 1, f"rollout.n must be >= 1, got {r.n}")
        need(r.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {r.max_new_tokens}")
        if not r.greedy:
            need(r.temperature > 0, f"rollout.temperature must be > 0 (or rollout.greedy=true), "
                                    f"got {r.temperature}")
        need(r.top_k >= 0, f"rollout.top_k must be >= 0 (0 = off), got {r.top_k}")
        need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1] (1 = off), got {r.top_p}")
        need(all(i >= 0 for i in r.stop_token_ids),
             f"rollout.stop_token_ids must be token ids >= 0, got {r.stop_token_ids}")

        # actor
        samples = d.batch_size * r.n
        need(a.lr >= 0, f"actor.lr must be >= 0, got {a.lr}")
        need(a.weight_decay >= 0, f"actor.weight_decay must be >= 0, got {a.weight_decay}")
        need(a.clip_grad >= 0, f"actor.clip_grad must be >= 0 (0 = off), got {a.clip_grad}")
        need(a.warmup_steps >= 0, f"actor.warmup_steps must be >= 0, got {a.warmup_steps}")
        need(a.ppo_epochs >= 1, f"actor.ppo_epochs must be >= 1, got {a.ppo_epochs}")
        if a.mini_batch_size < 1:
            errors.append(f"actor.mini_batch_size must be >= 1, got {a.mini_batch_size}")
        elif samples % a.mini_batch_size:
            errors.append(f"data.batch_size * rollout.n = {d.batch_size} * {r.n} = {samples} "
                          f"sequences per step is not divisible by actor.mini_batch_size "
                          f"({a.mini_batch_size})")
        longest = d.max_prompt_length + r.max_new_tokens
        need(a.micro_batch_tokens >= longest,
             f"actor.micro_batch_tokens ({a.micro_batch_tokens}) is smaller than the longest "
             f"sequence, data.max_prompt_length + rollout.max_new_tokens = {longest}")
        need(0 < a.clip_ratio_low < 1, f"actor.clip_ratio_low must be in (0, 1), got "
                                       f"{a.clip_ratio_low}")
        need(a.clip_ratio_high > 0, f"actor.clip_ratio_high must be > 0, got {a.clip_ratio_high}")
        need(a.clip_ratio_c > 1, f"actor.clip_ratio_c (dual clip) must be > 1, got "
                                 f"{a.clip_ratio_c}")
        need(a.entropy_coef >= 0, f"actor.entropy_coef must be >= 0, got {a.entropy_coef}")
        need(a.kl_loss_coef >= 0, f"actor.kl_loss_coef must be >= 0, got {a.kl_loss_coef}")

        # critic
        if alg.adv_estimator == "gae":
            need(c.enable, "algorithm.adv_estimator=gae needs a critic: set critic.enable=true "
                           "(or use adv_estimator=grpo / rloo)")
        if c.path is not None and not os.path.exists(os.path.expanduser(c.path)) and \
                (os.path.isabs(c.path) or c.path.startswith((".", "~"))):
            errors.append(f"critic.path: {c.path!r} does not exist")
        need(c.lr >= 0, f"critic.lr must be >= 0, got {c.lr}")
        need(c.weight_decay >= 0, f"critic.weight_decay must be >= 0, got {c.weight_decay}")
        need(c.clip_grad >= 0, f"critic.clip_grad must be >= 0 (0 = off), got {c.clip_grad}")
        need(c.cliprange_value > 0, f"critic.cliprange_value must be > 0, got {c.cliprange_value}")
        need(c.warmup_steps >= 0, f"critic.warmup_steps must be >= 0, got {c.warmup_steps}")

        # reward
        if rw.type == "rule":
            if not rw.function:
                errors.append("reward.type=rule needs reward.function (a dotted path "
                              "'package.module.function')")
            else:
                from parallel_models.rl.rewards import load_reward_function

                try:
                    load_reward_function(rw.function)
                except ConfigError as err:
                    errors.append(f"reward.function: {err}")
        else:
            need(bool(rw.model_path), "reward.type=model needs reward.model_path (an HF "
                                      "sequence-classification folder)")
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(rw, key)
            need(value is None or value == getattr(par, key),
                 f"reward.{key}={value}: in this version the reward model shares the actor's "
                 f"model-parallel groups, so it must equal parallel.{key} "
                 f"({getattr(par, key)}) or be left unset")

        # algorithm
        if alg.adv_estimator in ("grpo", "rloo"):
            need(r.n >= 2, f"algorithm.adv_estimator={alg.adv_estimator} compares the samples "
                           f"of a prompt: it needs rollout.n >= 2, got {r.n}")
        need(0 <= alg.gamma <= 1, f"algorithm.gamma must be in [0, 1], got {alg.gamma}")
        need(0 <= alg.lam <= 1, f"algorithm.lam must be in [0, 1], got {alg.lam}")
        need(alg.kl_coef >= 0, f"algorithm.kl_coef must be >= 0, got {alg.kl_coef}")
        if alg.kl_ctrl == "adaptive":
            need(alg.kl_target > 0, f"algorithm.kl_target must be > 0, got {alg.kl_target}")
            need(alg.kl_horizon > 0, f"algorithm.kl_horizon must be > 0, got {alg.kl_horizon}")
            need(alg.kl_in_reward, "algorithm.kl_ctrl=adaptive adjusts the in-reward KL "
                                   "coefficient: it needs algorithm.kl_in_reward=true")

        # trainer
        need(t.total_steps >= 0, f"trainer.total_steps must be >= 0, got {t.total_steps}")
        need(t.log_every >= 1, f"trainer.log_every must be >= 1, got {t.log_every}")
        need(t.save_every >= 0, f"trainer.save_every must be >= 0 (0 = never), got "
                                f"{t.save_every}")
        need(bool(t.output_dir), "trainer.output_dir must not be empty")
        if t.offload or rw.offload:
            import torch

            if not torch.cuda.is_available():
                logger.warning("trainer.offload / reward.offload only act on CUDA; ignored here")

        # data parallel layout
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        model_par = par.tensor_parallel_size * par.pipeline_parallel_size
        if model_par >= 1 and world_size % model_par:
            errors.append(f"world size {world_size} is not divisible by tensor_parallel_size * "
                          f"pipeline_parallel_size = {model_par}")
        elif model_par >= 1:
            dp = world_size // model_par
            need(d.batch_size % dp == 0, f"data.batch_size ({d.batch_size}) is not divisible by "
                                         f"the data-parallel size ({dp} = world size {world_size}"
                                         f" / {model_par})")
            need(a.mini_batch_size % dp == 0, f"actor.mini_batch_size ({a.mini_batch_size}) is "
                                              f"not divisible by the data-parallel size ({dp})")

        if errors:
            head = "invalid PPO config:" if len(errors) > 1 else "invalid PPO config: "
            raise ConfigError(head + ("\n  - " + "\n  - ".join(errors) if len(errors) > 1
                                      else errors[0]))
        return self


# ---- loading -----------------------------------------------------------------------------------
def default_config_path() -> str:
    """The packaged example config that mirrors the built-in defaults."""
    return str(importlib.resources.files("parallel_models.rl") / "configs" / "default.yaml")


def parse_override(text: str) -> tuple[str, Any]:
    """``"actor.lr=1e-5"`` -> ``("actor.lr", 1e-05)``; the value goes through yaml.safe_load."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value "
                          "(e.g. trainer.total_steps=20)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.startswith("--"):
        key = key[2:]
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {err}") from None
    return key, value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                validate: bool = True) -> PPOConfig:
    """Defaults <- YAML file (if any) <- ``key=value`` overrides; then ``validate()``."""
    cfg = PPOConfig()
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path) as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as err:
                raise ConfigError(f"{path}: not valid YAML: {err}") from None
        cfg.update(data or {}, source=path)
    for text in overrides or []:
        key, value = parse_override(text)
        cfg.set(key, value, source=f"override {text!r}")
    if validate:
        cfg.validate()
    return cfg


# ---- typing helpers ----------------------------------------------------------------------------
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(klass: type) -> dict[str, Any]:
    if klass not in _HINTS:
        names = [f.name for f in dataclasses.fields(klass)]
        hints = typing.get_type_hints(klass)
        _HINTS[klass] = {n: hints[n] for n in names}
    return _HINTS[klass]


def _section_class(section: str, source: str) -> type:
    if section not in SECTIONS:
        raise ConfigError(_unknown(section, section, list(SECTIONS), "the config (sections)",
                                   source))
    return SECTIONS[section]


def _unknown(full: str, name: str, valid: list[str], where: str, source: str) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"{source}: unknown key {full!r}{hint}; valid keys of {where}: "
            f"{', '.join(sorted(valid))}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a)
                           for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_type_name(inner)}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    def bad(extra: str = "") -> ConfigError:
        return ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} "
                           f"({type(value).__name__}){extra}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise bad()
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise bad(" (write a YAML list, e.g. [2, 13])")
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                raise bad() from None
            if f.is_integer():
                return int(f)
        raise bad()
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad()
    raise TypeError(f"{key}: unsupported field type {tp!r}")  # a bug in this module


__all__ = ["PPOConfig", "SECTIONS", "ConfigError", "load_config", "parse_override",
           "default_config_path"] + [k.__name__ for k in SECTIONS.values()]
