"""Kernel and engine options: one validated model of the switches that pick kernels and engine
behaviour (compilation, CUDA graphs, decode kernels, MoE paths, gradient buffers), and the
process-wide value the library reads them from.

    from parallel_models.options import get_options, option, options_override, set_options

    set_options({"cuda_graphs": False})        # the run's options (the PPO trainer: `kernels:`)
    option("cuda_graphs")                      # one value, as a read site asks for it (cheap)
    get_options()                              # every value, environment overrides applied
    with options_override(fused_draw=False):   # tests and benches: wins over everything
        ...

Where a value comes from, last wins: the field's default <- :func:`set_options` (the PPO
config's ``kernels:`` section, the server's ``--option key=value``) <- the environment variable
``PARALLEL_MODELS_<FIELD>`` (e.g. ``PARALLEL_MODELS_CUDA_GRAPHS=0``; validated, a bad value is a
:class:`ConfigError` naming the variable, and a log line says so once when it takes effect) <-
:func:`options_override`. The environment is read each time a value is read (as the modules read
their variables before), so a variable set later in the process (a test, a rank function) still
counts. When the modules read a value (at each call, when a layer or an engine is built, once per
process) is said in each field's description.

Secrets are not options: the rollout server's API key comes from ``PARALLEL_MODELS_API_KEY`` (or
``--api-key``) and is never part of this model, so it is never written to a run's ``config.yaml``.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from typing import Any, Iterator, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from parallel_models.errors import ConfigError

ENV_PREFIX = "PARALLEL_MODELS_"
LOG = logging.getLogger(__name__)

# the fields of elementwise_triton.LaunchConfig (a test checks they agree)
ElementwiseLaunchField = Literal["swiglu_block", "swiglu_warps", "norm_tile",
                                 "norm_programs_per_sm"]


class KernelOptions(BaseModel):
    """Kernel and engine options (an environment variable PARALLEL_MODELS_<NAME> overrides each).

    The rollout server's API key is a secret, not an option: never part of this model."""

    model_config = ConfigDict(extra="forbid")

    # ---- compilation and elementwise kernels (training and prefill) ---------------------------
    compile: bool = Field(True, description="torch.compile the elementwise / norm code on CUDA "
                          "(utils/gpu_compile; read at the first CUDA call)")
    triton_elementwise: bool = Field(False, description="hand-written Triton SwiGLU / RMSNorm "
                                     "kernels on CUDA (llama/layers/elementwise_triton; each "
                                     "call)")
    elementwise_launch: dict[ElementwiseLaunchField, int] = Field(
        default_factory=dict, description="launch fields of those kernels over their defaults, "
        "e.g. {norm_tile: 8192} (env: 'norm_tile=8192,swiglu_block=512'; each call)")
    disable_flash_attn: bool = Field(False, description="never use flash-attn's varlen kernel "
                                     "(read at its first use)")
    # ---- decode engine ------------------------------------------------------------------------
    cuda_graphs: bool = Field(True, description="replay decode steps from CUDA graphs (read "
                              "when an engine is built)")
    decode_pipeline: Literal["auto"] | bool = Field(
        "auto", description="queue each decode step before reading the previous one's tokens "
        "(continuous engine; auto = on CUDA; read when an engine is built)")
    decode_attention: Literal["triton", "aten"] = Field(
        "triton", description="decode attention: triton = the split-KV kernel where it works, "
        "aten = PyTorch's (read when a KV pool is built)")
    decode_fuse_norm: bool = Field(True, description="fuse each layer's residual add into the "
                                   "next norm in generation (each forward)")
    decode_fuse_rope: bool = Field(True, description="rotate q / k inside the split-KV decode "
                                   "kernel (each step)")
    decode_kernel_config: Optional[str] = Field(
        None, description="split-KV launch 'block_n,warps,stages[,split]' for every shape; "
        "null = the tuned table (read when a bucket is captured)")
    decode_split: Optional[int] = Field(None, description="fixed split-KV split size (a power "
                                        "of two >= 16); null = automatic")
    fused_draw: bool = Field(True, description="fused sampling draw kernels (each draw)")
    # ---- mixture of experts -------------------------------------------------------------------
    moe_grouped_gemm: Literal["auto"] | bool = Field(
        "auto", description="experts as grouped GEMMs; auto = on Hopper+ CUDA with bf16 (each "
        "forward)")
    moe_packed_experts: bool = Field(True, description="inference reads the experts' weights "
                                     "packed in place instead of stacking them (each forward)")
    moe_device_dispatch: bool = Field(True, description="no-autograd MoE token dispatch on the "
                                      "device (megatron-core's dispatcher when off; each "
                                      "forward)")
    # ---- gradients and tensor-parallel communication ------------------------------------------
    grad_first_write: bool = Field(True, description="the first gradient of a step writes the "
                                   "grad buffer instead of zero + add (read when DDP is built)")
    grad_buffer_kernel: bool = Field(True, description="Triton kernel for those grad-buffer "
                                     "writes on CUDA (each write)")
    wgrad_fusion: bool = Field(False, description="weight gradients accumulate straight into "
                               "DDP's buffers (read when DDP is built)")
    tp_overlap_chunks: int = Field(0, ge=0, description="row-parallel GEMM split into k chunks "
                                   "overlapped with the TP reduction; 0/1 = off (read when a "
                                   "layer is built)")

    @field_validator("elementwise_launch", mode="before")
    @classmethod
    def _launch_from_text(cls, value: Any) -> Any:
        """``"norm_tile=8192, swiglu_block=512"`` (the environment's form) -> a mapping."""
        if not isinstance(value, str):
            return value
        out = {}
        for item in filter(None, (p.strip() for p in value.split(","))):
            key, sep, number = item.partition("=")
            if not sep:
                raise ValueError(f"expected 'field=value,...', got item {item!r}")
            out[key.strip()] = number.strip()
        return out

    @field_validator("elementwise_launch")
    @classmethod
    def _launch_positive(cls, value: dict) -> dict:
        bad = [k for k, v in value.items() if v < 1]
        if bad:
            raise ValueError(f"launch fields must be >= 1: {', '.join(bad)}")
        return value

    @field_validator("decode_kernel_config")
    @classmethod
    def _kernel_config_shape(cls, value: Optional[str]) -> Optional[str]:
        """3 or 4 integers; the values themselves are checked by ``split_kv_config.parse``."""
        if value is None:
            return None
        parts = [p.strip() for p in value.split(",")]
        if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
            raise ValueError("expected 'block_n,warps,stages' or 'block_n,warps,stages,split' "
                             "(integers)")
        return ",".join(parts)

    @field_validator("decode_split")
    @classmethod
    def _split_power_of_two(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError("must be a power of two >= 16")
        return value

    @classmethod
    def build(cls, data: Mapping[str, Any] | None, source: str = "options") -> KernelOptions:
        """Validate a mapping of options; a ConfigError naming each bad key (with a
        did-you-mean for an unknown one)."""
        try:
            return cls.model_validate(dict(data or {}))
        except ValidationError as err:
            raise ConfigError("\n".join(_messages(err, source))) from None


FIELDS = tuple(KernelOptions.model_fields)
ENV_VARS: dict[str, str] = {name: ENV_PREFIX + name.upper() for name in FIELDS}


def env_var(name: str) -> str:
    """The environment variable of option ``name`` (``cuda_graphs`` -> ...CUDA_GRAPHS)."""
    _check_name(name)
    return ENV_VARS[name]


def _check_name(name: str, source: str = "options") -> None:
    if name not in ENV_VARS:
        raise ConfigError(_unknown(name, source))


def _unknown(name: str, source: str) -> str:
    close = difflib.get_close_matches(str(name), FIELDS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{source}: unknown option {name!r}{hint}; options: {', '.join(FIELDS)}"


def _problem(e: dict) -> str:
    return str(e.get("msg", "")).removeprefix("Value error, ")


def _messages(err: ValidationError, source: str) -> list[str]:
    out = []
    for e in err.errors():
        key = str(e["loc"][0]) if e.get("loc") else ""
        if e["type"] == "extra_forbidden":
            out.append(_unknown(key, source))
        else:
            where = ".".join(str(p) for p in e.get("loc", ()))
            out.append(f"{source}: {where}: {_problem(e)}, got {e.get('input')!r}")
    return out


# ---- the process-wide value ----------------------------------------------------------------------
_base = KernelOptions()  # set_options
_forced: dict[str, Any] = {}  # options_override, above everything
_from_env: dict[tuple[str, str], Any] = {}  # (name, raw text) -> validated value
_logged: set[tuple[str, str]] = set()


def _env_value(name: str) -> tuple[bool, Any]:
    """(True, value) when the option's environment variable is set (validated), else (False, _)."""
    var = ENV_VARS[name]
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return False, None
    key = (name, raw)
    if key not in _from_env:
        try:
            value = getattr(KernelOptions.model_validate({name: raw.strip()}), name)
        except ValidationError as err:
            problem = "; ".join(dict.fromkeys(_problem(e) for e in err.errors()))
            raise ConfigError(f"{var}={raw!r}: {problem} (the option {name!r}: "
                              f"{KernelOptions.model_fields[name].description})") from None
        _from_env[key] = value
    value = _from_env[key]
    if key not in _logged:
        _logged.add(key)
        LOG.info("%s=%s sets the option %s to %r (configured: %r)", var, raw, name, value,
                 getattr(_base, name))
    return True, value


def option(name: str) -> Any:
    """The current value of one option: :func:`options_override`, else its environment
    variable, else :func:`set_options`' value, else the default. Cheap (the read sites call it
    per step)."""
    if name in _forced:
        return _forced[name]
    if name not in ENV_VARS:
        _check_name(name)
    is_set, value = _env_value(name)
    return value if is_set else getattr(_base, name)


def get_options() -> KernelOptions:
    """Every option's current value (what :func:`option` returns for each) as a new model."""
    return _base.model_copy(update={name: option(name) for name in FIELDS}, deep=True)


def set_options(options: KernelOptions | Mapping[str, Any] | None = None,
                source: str = "options") -> KernelOptions:
    """Make ``options`` (a model or a mapping; None = the defaults) the process's options;
    returns the effective options (environment overrides applied, each validated and logged
    again; a bad value is a ConfigError naming ``source`` or the environment variable)."""
    global _base
    if isinstance(options, KernelOptions):
        _base = options.model_copy(deep=True)
    else:
        _base = KernelOptions.build(options, source)
    _logged.clear()
    return get_options()


@contextlib.contextmanager
def options_override(**values: Any) -> Iterator[KernelOptions]:
    """Set options for the ``with`` block, over the environment and :func:`set_options`
    (tests, benches); yields the effective options."""
    for name in values:
        _check_name(name, "options_override")
    checked = KernelOptions.build({**_base.model_dump(), **values}, "options_override")
    before = dict(_forced)
    _forced.update({name: getattr(checked, name) for name in values})
    try:
        yield get_options()
    finally:
        _forced.clear()
        _forced.update(before)


def parse_assignments(items: list[str] | None, source: str = "--option") -> dict[str, Any]:
    """``["cuda_graphs=false", "decode_split=64"]`` -> a mapping (YAML values), for CLIs; a
    ConfigError for a malformed item or an unknown option."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{source} {item!r}: expected name=value (options: "
                              f"{', '.join(FIELDS)})")
        _check_name(key, f"{source} {item!r}")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(f"{source} {item!r}: the value is not valid YAML: {err}") from None
    return out


__all__ = ["ENV_VARS", "ElementwiseLaunchField", "FIELDS", "KernelOptions", "env_var",
           "get_options", "option", "options_override", "parse_assignments", "set_options"]
