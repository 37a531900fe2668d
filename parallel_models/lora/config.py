"""LoRA settings (rank, alpha, dropout, target modules) with PEFT's names and scaling.

``target_modules`` takes PEFT's module names of a Llama-style decoder: ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, or ``"all-linear"`` (all of
them: PEFT's ``all-linear`` adapts every linear but the output head). The adapter's output is
scaled by ``alpha / rank`` as PEFT's ``LoraConfig`` (without ``use_rslora``) does.
"""

from __future__ import annotations

import dataclasses

from parallel_models.errors import ConfigError

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
ALL_LINEAR = "all-linear"
# PEFT's target_parameters of an MoE layer's fused experts (lora/experts.py) -> our targets
EXPERT_PARAMETERS = {"mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),
                     "mlp.experts.down_proj": ("down_proj",)}
# PEFT's modules_to_save of a SEQ_CLS model (our value head is HF's ``score``)
VALUE_HEAD_MODULES = ("classifier", "score")


def resolve_targets(target_modules, key: str = "target_modules") -> tuple[str, ...]:
    """PEFT's ``target_modules`` (a name, a list of names, or ``all-linear``) -> the sorted
    tuple of projection names; a ConfigError naming ``key`` for anything else."""
    if isinstance(target_modules, str):
        target_modules = list(ALL_TARGETS) if target_modules == ALL_LINEAR else [target_modules]
    names = list(target_modules)
    if not names:
        raise ConfigError(f"{key}: empty; name projections ({', '.join(ALL_TARGETS)}) or "
                          f"{ALL_LINEAR!r}")
    unknown = [n for n in names if n not in ALL_TARGETS]
    if unknown:
        raise ConfigError(f"{key}: unknown module(s) {unknown}; known: {', '.join(ALL_TARGETS)} "
                          f"or {ALL_LINEAR!r}")
    return tuple(n for n in ALL_TARGETS if n in names)


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """One LoRA configuration. ``init_seed``: the seed of the A matrices' initialization (each
    projection's A is drawn at its full size from a generator seeded by it, the layer and the
    projection, so every layout starts from the same adapters)."""

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ALL_LINEAR
    init_seed: int = 0

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"lora alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "target_modules", resolve_targets(self.target_modules))

    @property
    def scale(self) -> float:
        """PEFT's ``scaling``: ``alpha / rank``."""
        return self.alpha / self.rank

    def peft_config(self, value_head: bool = False, experts: bool = False,
                    linear_mlp: bool = True) -> dict:
        """The ``adapter_config.json`` fields PEFT reads for this configuration (plus
        ``base_model_name_or_path``, set by the writer). ``value_head``: a critic, PEFT's
        ``SEQ_CLS`` task whose ``modules_to_save`` (the ``score`` head) is saved whole.
        ``experts``: an MoE model, whose MLP targets are also its experts' ``target_parameters``;
        ``linear_mlp`` False: it has no linear MLP (dense layer, shared expert) for the MLP names
        in ``target_modules``, which are then left out."""
        modules = [t for t in self.target_modules if linear_mlp or t not in MLP_TARGETS]
        params = [p for p, names in EXPERT_PARAMETERS.items()
                  if experts and names[0] in self.target_modules]
        return {"peft_type": "LORA", "task_type": "SEQ_CLS" if value_head else "CAUSAL_LM",
                "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": modules, "bias": "none",
                "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
                "init_lora_weights": True, "inference_mode": True,
                "modules_to_save": list(VALUE_HEAD_MODULES) if value_head else None,
                **({"target_parameters": params} if params else {})}

    @classmethod
    def from_peft_config(cls, cfg: dict) -> "LoraSettings":
        """The settings of a PEFT ``adapter_config.json``; a ConfigError for what we do not run
        (DoRA, rsLoRA, per-module ranks, trained biases, ...)."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ConfigError(f"adapter_config.json: peft_type {cfg.get('peft_type')!r} is not LORA")
        for key, ok in (("use_dora", False), ("use_rslora", False), ("bias", "none"),
                        ("fan_in_fan_out", False)):
            if cfg.get(key, ok) != ok:
                raise ConfigError(f"adapter_config.json: {key}={cfg[key]!r} is not supported "
                                  f"(only {key}={ok!r})")
        for key in ("rank_pattern", "alpha_pattern"):
            if cfg.get(key):
                raise ConfigError(f"adapter_config.json: {key} is not supported")
        saved = set(cfg.get("modules_to_save") or ())
        if saved - set(VALUE_HEAD_MODULES):
            raise ConfigError(f"adapter_config.json: modules_to_save {sorted(saved)} is not "
                              f"supported (only a value model's head: {list(VALUE_HEAD_MODULES)})")
        targets = cfg.get("target_modules")
        if isinstance(targets, str) and targets != ALL_LINEAR:
            raise ConfigError(f"adapter_config.json: target_modules regex {targets!r} is not "
                              "supported; list the module names")
        params = list(cfg.get("target_parameters") or ())
        unknown = [p for p in params if p not in EXPERT_PARAMETERS]
        if unknown:
            raise ConfigError(f"adapter_config.json: target_parameters {unknown} are not "
                              f"supported (only an MoE layer's {sorted(EXPERT_PARAMETERS)})")
        if params:
            targets = list(resolve_targets(targets)) if targets else []
            targets += [t for p in params for t in EXPERT_PARAMETERS[p]]
        return cls(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]),
                   dropout=float(cfg.get("lora_dropout", 0.0)), target_modules=targets)
