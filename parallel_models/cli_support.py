"""What every console script shares (``parallel-models-ppo``, ``parallel-models-serve``,
``hf2mcore``, ``mcore2hf``): nothing here imports torch, megatron-core or transformers, so
``--help``, ``--version`` and argument errors answer before any heavy import.

- :func:`quiet_third_party`: the warning filters for third-party import-time notes (megatron-core's
  "Transformer Engine and Apex are not installed", deprecation notes), installed once at an entry
  point, never on import of a library module;
- :func:`optional_pieces_note`: one line naming the optional GPU pieces that are missing and what
  runs instead (instead of megatron-core's four warnings);
- :func:`add_version_argument`: ``--version`` (the installed package's version);
- :func:`dtype_name` / :func:`dtype_or_auto`: the ``--dtype`` argument type. One spelling is
  documented everywhere, as in the YAML config: ``float32``, ``bfloat16``, ``float16``; the short
  forms ``fp32``, ``bf16``, ``fp16`` are accepted and mean the same;
- :class:`DefaultsHelpFormatter`: every option's help ends with its default;
- :func:`error_exit`: the one-line ``prog: error: ...`` message and exit code 2 of argparse, for
  problems found after parsing (missing model folder, busy port).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import warnings

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_HELP = "float32 | bfloat16 | float16 (fp32 / bf16 / fp16 also accepted)"

# optional piece: (module, distribution name, what runs without it)
OPTIONAL_PIECES = (("transformer_engine", "transformer-engine", "local layers"),
                   ("apex", "apex", "torch optimizers"),
                   ("flash_attn", "flash-attn", "torch SDPA / aten flash attention"))

# warnings third-party packages emit on import or first use that say nothing to our users
_QUIET_MESSAGES = (
    r".*(Transformer Engine|Apex).*not installed",  # megatron-core: the optional GPU extras
    r".*apex.*",  # megatron-core / transformer-engine: apex fallbacks
    r"full scope is deprecated",  # megatron-core 0.16 TransformerConfig: cuda_graph_scope
)
# deprecation notes torch emits from calls that pass through our code (the CPU shim's torch
# function mode), so the module filter below does not see them: megatron-core's dist checkpoints
# are made of ShardedTensors, nothing a user can change
_QUIET_DEPRECATIONS = (r"Please use DTensor instead and we are deprecating ShardedTensor",)
_THIRD_PARTY = r"(megatron|transformer_engine|apex|transformers|torch|torchvision|pydantic)(\.|$)"
_installed = False


def quiet_third_party() -> None:
    """Install the filters for third-party import notes (idempotent). Call it first thing in an
    entry point's ``main``; our own warnings and third-party errors still show."""
    global _installed
    if _installed:
        return
    _installed = True
    for message in _QUIET_MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_THIRD_PARTY)
        for message in _QUIET_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=category)
    # transformers' advisory notes (logged, not warned); a user's own setting wins
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("megatron").setLevel(logging.WARNING)


def missing_optional_pieces() -> list[tuple[str, str]]:
    """``(distribution, what runs instead)`` of each optional GPU piece that is not installed."""
    return [(dist, instead) for module, dist, instead in OPTIONAL_PIECES
            if importlib.util.find_spec(module) is None]


def optional_pieces_note() -> str | None:
    """One line, e.g. ``transformer-engine not installed: using local layers; ...``; None when
    everything optional is there."""
    missing = missing_optional_pieces()
    if not missing:
        return None
    return "; ".join(f"{dist} not installed: using {instead}" for dist, instead in missing)


def log_optional_pieces(logger: logging.Logger) -> None:
    note = optional_pieces_note()
    if note:
        logger.info(note)


def package_version() -> str:
    from parallel_models import __version__  # importlib.metadata's, read once by the package

    return __version__


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {package_version()} (parallel-models)",
                        help="print the version and exit")


def dtype_name(value: str) -> str:
    """argparse type: the canonical dtype name (``bf16`` -> ``bfloat16``)."""
    name = str(value).strip().lower().replace("torch.", "")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}; use {DTYPE_HELP}")
    return name


def dtype_or_auto(value: str) -> str:
    """argparse type: ``auto`` or a dtype name as :func:`dtype_name`."""
    if str(value).strip().lower() == "auto":
        return "auto"
    try:
        return dtype_name(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}; use auto or {DTYPE_HELP}") from None


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: ...)`` after each option's help, unless the help already says what
    the default is (e.g. one read from the environment, which must not be printed)."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def error_exit(prog: str, message, code: int = 2) -> int:
    """Print ``prog: error: message`` (argparse's form; one line for one problem, a list keeps
    its lines) to stderr; return ``code``."""
    print(f"{prog}: error: {str(message).strip()}", file=sys.stderr)
    return code
