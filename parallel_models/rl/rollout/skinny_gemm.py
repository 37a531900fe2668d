"""Skinny GEMM for decode steps: ``y = x @ W^T (+ bias)`` with few rows of x, streaming W once.

At decode the linears multiply a handful of rows (the batch bucket, <= 256) by a large weight,
so they are bound by reading W from memory. cuBLAS picks split-K plus a separate reduction
kernel for the skinny products (o_proj 2.33x its weight-read floor on an H100 at M = 64,
docs/PERFORMANCE.md "Issue 17 item 4"); this Triton kernel (``skinny_gemm_kernels``) instead
computes ``W_tile @ x^T`` (N on the MMA's M side), sums its K splits in-kernel (each split
stores its fp32 partial; the last split of a tile to finish adds them in split order: the same
bits every run) and needs no second launch.

- ``x [..., K]`` bf16 with ``rows = x.numel() / K`` <= 256, ``W [N, K]`` bf16 with unit stride
  along K (``nn.Linear`` / megatron layout), fp32 accumulation, bf16 out ``[..., N]``.
- Graph-capturable: no host sync, nothing allocated but the output. The split-K workspace
  (splits x ``rows`` rounded up x N fp32) and its tile counters (zero at rest) are allocated on
  the first eager call of a shape and kept for the process; a call captured before its shape ran
  eagerly uses ``split_k = 1`` instead. One stream at a time may use a shape's workspace (the
  engine decodes on one stream). Deterministic: the same inputs give the same bits.
- Launch settings: ``skinny_gemm_config`` (an env var, a table by shape, a byte-math default).

When it is used (:func:`use_skinny`, the one rule, asked by :func:`decode_linear`, the one hook
the linears call): ``PARALLEL_MODELS_DECODE_GEMM=triton`` (default ``cublas``: off until the GPU
measurement says it wins), a CUDA tensor (or any under ``TRITON_INTERPRET=1``, the CPU tests),
no autograd (``torch.is_grad_enabled()`` false: generation), rows <= 256, bf16 x and W, the
launch-config table does not mark the shape as cuBLAS's (a ``None`` entry), exact mode off (its
batch-invariant kernels own every product then), triton imports and the kernel matched
``torch.matmul`` on this device once (:func:`supported`).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from parallel_models.errors import ConfigError
from parallel_models.rl.rollout.skinny_gemm_config import (MAX_ROWS, LaunchConfig,
                                                           cublas_preferred, launch_config)

ENV = "PARALLEL_MODELS_DECODE_GEMM"
MODES = ("cublas", "triton")
DEFAULT_MODE = "cublas"  # flipped to "triton" once the H100 sweep shows it faster


def mode() -> str:
    """``PARALLEL_MODELS_DECODE_GEMM`` (``cublas`` or ``triton``; default :data:`DEFAULT_MODE`)."""
    value = os.environ.get(ENV, DEFAULT_MODE) or DEFAULT_MODE
    if value not in MODES:
        raise ConfigError(f"{ENV}={value!r}: expected one of {MODES}")
    return value


def _runs_here(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight^T`` goes to the skinny kernel (the rule of the module docstring)."""
    if mode() != "triton" or torch.is_grad_enabled():
        return False
    k = x.shape[-1] if x.dim() else 0
    rows = x.numel() // k if k else 0
    if not (0 < rows <= MAX_ROWS and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] == k
            and weight.stride(1) == 1 and x.device == weight.device and _runs_here(x)):
        return False
    if cublas_preferred(rows, weight.shape[0], k):
        return False  # measured: cuBLAS is faster at this shape (skinny_gemm_config.TUNED)
    from parallel_models.llama.layers import exact  # local: the layers import this module

    if exact.enabled():
        return False
    if x.device not in _CHECKED and _capturing(x.device):
        return False  # the one-time check cannot run inside a graph capture
    return supported(x.device)


def decode_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The hook of the linears: ``x @ weight^T + bias`` by the skinny kernel when
    :func:`use_skinny` says so, else None (the caller runs its usual GEMM)."""
    if not use_skinny(x, weight) or (bias is not None and (
            bias.shape != (weight.shape[0],) or bias.stride(0) != 1)):
        return None
    return skinny_linear(x, weight, bias)


@functools.cache
def available() -> bool:
    """True when triton imports (the kernel is compiled on first use)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken triton: cuBLAS stays
        return False
    return True


_CHECKED: dict[torch.device, bool] = {}


def supported(device: torch.device) -> bool:
    """Triton imports and the kernel matches ``torch.matmul`` (fp32, rounded to bf16) on
    ``device`` for a few shapes (masked edges, one and several K splits, a bias): checked once;
    a failure warns and returns False (the linears keep cuBLAS)."""
    device = torch.device(device)
    if device in _CHECKED:
        return _CHECKED[device]
    ok = available()
    if ok:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            # one tile, split or not, N off the tile, K a whole number of steps or not
            for rows, n, k, split in ((3, 40, 48, 1), (5, 72, 80, 3), (17, 72, 64, 2)):
                x = torch.randn(rows, k, device=device, generator=g).to(torch.bfloat16)
                w = torch.randn(n, k, device=device, generator=g).to(torch.bfloat16)
                b = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
                config = LaunchConfig(16, 32, 16, split, 4, 2)
                for _ in range(2):  # twice: the workspace must be left clean
                    got = skinny_linear(x, w, b, config=config).float()
                want = reference_linear(x, w, b).float()
                err = ((got - want).abs() - 1e-2 * want.abs()).max().item()
                if not err < 1e-2:
                    raise AssertionError(f"error {err} vs torch.matmul ({rows}x{n}x{k})")
        except Exception as exc:  # noqa: BLE001 - any failure: cuBLAS instead
            warnings.warn(f"skinny decode GEMM disabled: {type(exc).__name__}: {exc}")
            ok = False
    _CHECKED[device] = ok
    return ok


def reference_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`skinny_linear` computes: fp32 ``x @ W^T + bias`` rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@functools.cache
def _kernel():
    import triton

    from parallel_models.rl.rollout import skinny_gemm_kernels

    return triton, skinny_gemm_kernels.skinny_kernel


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, rows: int, n: int, split: int) -> tuple | None:
    """The fp32 ``[split, rows', n]`` partial sums and zeroed int32 tile counters of a split-K
    call (``rows'`` = rows rounded up to a power of two >= 16; counters for the thinnest tiles);
    None when it does not exist yet and a graph is being captured. Never freed: a captured graph
    keeps their addresses."""
    padded = max(16, 1 << (rows - 1).bit_length())
    key = (device, padded, n, split)
    if key not in _WORKSPACES:
        if _capturing(device):
            return None
        tiles = -(-n // 16) * -(-padded // 16)
        _WORKSPACES[key] = (torch.empty(split * padded * n, dtype=torch.float32, device=device),
                            torch.zeros(tiles, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: LaunchConfig | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias [N])`` -> ``[..., N]`` in x's dtype, fp32
    accumulation (any row count; the kernel is meant for <= 256). ``config``: the launch
    settings (default: ``skinny_gemm_config.launch_config`` of the shape)."""
    triton, kernel = _kernel()
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"skinny GEMM needs weight [N, {k}] with unit stride along K, got "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"skinny GEMM needs bias [{n}] contiguous, got {tuple(bias.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y.reshape(*x.shape[:-1], n)
    if config is None:
        config = launch_config(rows, n, k, _sms(x.device))
    split = max(1, min(config.split_k, triton.cdiv(k, config.block_k)))
    ws = locks = y  # unused without a split
    if split > 1:
        found = _workspace(x.device, rows, n, split)
        if found is None:
            split = 1
        else:
            ws, locks = found
    block_k = config.block_k
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    m_tiles = triton.cdiv(rows, config.block_m)
    n_tiles = triton.cdiv(n, config.block_n)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    kernel[(m_tiles * split * n_tiles,)](
        x2, weight, bias if bias is not None else weight, y, ws, locks, rows, n, k, split,
        k_split, m_tiles, x2.stride(0), weight.stride(0), y.stride(0), BLOCK_N=config.block_n,
        BLOCK_M=config.block_m, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN_K=k_split * split == k, EVEN_N=n % config.block_n == 0,
        UPCAST=interpret, num_warps=config.num_warps, num_stages=config.num_stages)
    return y.reshape(*x.shape[:-1], n)


__all__ = ["DEFAULT_MODE", "ENV", "MODES", "available", "decode_linear", "mode",
           "reference_linear", "skinny_linear", "supported", "use_skinny"]
