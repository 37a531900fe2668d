"""SwiGLU and RMSNorm (plain and residual-add) as autograd functions over hand-written Triton
kernels (``elementwise_kernels``), the CUDA training path of ``fused_ops``.

Why not ``torch.compile`` (``utils/gpu_compile``), which ``fused_ops`` used for them before:
inductor computes SwiGLU's backward ``cat([d_gate, d_up])`` one output element at a time, so it
loads gate, up and the incoming gradient twice (~1.7x the byte floor), and it splits RMSNorm's
backward into a dx pass and a second pass re-reading x and dy for the weight gradient. Here the
SwiGLU backward reads each input once and writes both halves of the ``[.., 2I]`` gradient
(the layout ``GateUpParallelLinear``'s backward takes), and the RMSNorm backward computes dx and
per-program fp32 partial weight gradients in one pass (the partials, ``[programs, N]``, are summed
after it).

Arithmetic: fp32 math, the tensors' dtypes for I/O, the eager reference's roundings
(``fused_ops._swiglu``, ``fused_ops._rms_norm``): silu's output and ``x * rstd`` are rounded to
the input dtype where eager rounds them, so bf16 forwards match eager's bits up to fp32 ulps of
``sigmoid`` / ``sqrt``. Inputs of any leading shape (flattened to rows; a copy only where the
last dim is not contiguous), any width (masked), bfloat16 / float16 / float32 (others keep the
compiled path); outputs come back contiguous in the input's shape.

Switch: opt-in, the option ``triton_elementwise`` (``parallel_models.options``; env
``PARALLEL_MODELS_TRITON_ELEMENTWISE=1``; :func:`set_enabled` forces it at run time). Measured on an
H100 (docs/PERFORMANCE.md, "Triton SwiGLU / RMSNorm kernels") the kernels reach their byte floors
and save 2.4 ms of a 378 ms Llama-3-8B step. They stay off by default for two reasons. In the same
session the 0.89B uniform training case ran slower with them and spread more across rounds (cause
not found). And Qwen3-MoE decode no longer gave the same tokens in CUDA graphs as eagerly: the
dispatch keeps strided inputs on the compiled kernels, so graph and eager steps can round a norm
differently and flip a near-tied route.
``gpu_compile.set_compilation(False)`` (exact mode, the benches' eager baselines) switches these
kernels off as well: they replace the compiled pieces. Set ``TRITON_INTERPRET=1`` before
importing triton to run them on the CPU (tests); ``fused_ops`` only sends CUDA tensors here.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from parallel_models.options import option
from parallel_models.utils import gpu_compile

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OVERRIDE: bool | None = None


@dataclass
class LaunchConfig:
    """Tile sizes and grids (module-wide; ``bench/elementwise_bench.py --sweep`` tries others).

    ``swiglu_block`` columns per program (``swiglu_warps`` warps); RMSNorm tiles hold whole rows,
    ``max(1, norm_tile // next_pow2(N))`` of them (``norm_warps``: warps per ``norm_tile``
    elements, 4..16); the backward runs ``norm_programs_per_sm`` programs per SM (each keeps one
    fp32 partial weight gradient; at hidden 4096 a program of 8 warps needs ~120 registers a
    thread, so two fit on an SM). The option ``elementwise_launch`` (env
    ``PARALLEL_MODELS_ELEMENTWISE_LAUNCH="norm_tile=8192,..."``) overrides fields (tuning
    without code changes)."""

    swiglu_block: int = 1024
    swiglu_warps: int = 4
    norm_tile: int = 4096
    norm_programs_per_sm: int = 2

    @classmethod
    def from_options(cls) -> LaunchConfig:
        """The defaults with the option ``elementwise_launch``'s fields over them."""
        return _configured(tuple(sorted(option("elementwise_launch").items())))


@functools.cache
def _configured(fields: tuple) -> LaunchConfig:
    return LaunchConfig(**dict(fields))


CONFIG: LaunchConfig | None = None  # set: used instead of the options (the bench's sweep)


def launch_config() -> LaunchConfig:
    """:data:`CONFIG` when set, else :meth:`LaunchConfig.from_options` (read at each call)."""
    return CONFIG or LaunchConfig.from_options()


def set_enabled(enabled: bool | None) -> None:
    """Force the kernels on / off at run time (``None``: back to the option)."""
    global _OVERRIDE
    _OVERRIDE = enabled


def enabled() -> bool:
    if _OVERRIDE is not None:
        return _OVERRIDE
    return option("triton_elementwise")


@functools.cache
def _kernels():
    from parallel_models.llama.layers.exact import interpreter_fix

    interpreter_fix.apply()  # the interpreter's run-time loop bounds (numpy >= 2.3)
    from parallel_models.llama.layers import elementwise_kernels

    return elementwise_kernels


@functools.cache
def available() -> bool:
    """True when triton and the kernel module import (kernels compile on first use)."""
    try:
        _kernels()
    except Exception as exc:  # noqa: BLE001 - missing or broken triton: the compiled path
        warnings.warn(f"Triton elementwise kernels unavailable ({type(exc).__name__}: {exc}); "
                      "the torch.compile'd ops are used", stacklevel=2)
        return False
    return True


def flat_rows(t: torch.Tensor) -> bool:
    """``t`` is ``[rows, last dim]`` through a view (one row stride, unit column stride)."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    expected = None
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return False
        expected = stride * size
    return True


def use_for(*tensors: torch.Tensor) -> bool:
    """Whether ``fused_ops`` sends these CUDA operands here: switched on, compilation on (not
    exact mode), not inside a ``torch.compile`` trace, supported dtypes, triton loads, and
    rows without a copy (e.g. Qwen3's q / k heads, strided views of the qkv output, keep the
    compiled kernels, which read them in place)."""
    return (tensors[0].is_cuda and not torch.compiler.is_compiling() and enabled()
            and gpu_compile.compilation_enabled()
            and all(t.dtype in DTYPES and flat_rows(t) for t in tensors) and available())


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: few programs, so each walks several tiles (tests)
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[rows, n]`` with a unit column stride (a view where the layout allows)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or n == 1 else t.contiguous()


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ------------------------------------------------------------------------------------ SwiGLU
def _swiglu_launch(kernel, rows: int, inter: int, *args) -> None:
    config = launch_config()
    block = min(_pow2(config.swiglu_block), _pow2(inter))
    col_blocks = -(-inter // block)
    if rows and inter:
        kernel[(rows * col_blocks,)](*args, col_blocks, BLOCK=block,
                                     num_warps=config.swiglu_warps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        two_inter = gate_up.shape[-1]
        if two_inter % 2:
            raise ValueError(f"swiglu needs an even last dim ([gate; up]), got {two_inter}")
        inter = two_inter // 2
        gu = _rows(gate_up, two_inter)
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
        out2 = out.view(-1, inter)
        _swiglu_launch(_kernels().swiglu_fwd_kernel, gu.shape[0], inter, gu, out2, inter,
                       gu.stride(0), out2.stride(0))
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        two_inter = gate_up.shape[-1]
        inter = two_inter // 2
        gu = _rows(gate_up, two_inter)
        d = _rows(dout, inter)
        dgu = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        dgu2 = dgu.view(-1, two_inter)
        _swiglu_launch(_kernels().swiglu_bwd_kernel, gu.shape[0], inter, gu, d, dgu2, inter,
                       gu.stride(0), d.stride(0), dgu2.stride(0))
        return dgu


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` holding [gate; up] -> ``silu(gate) * up`` ``[..., I]``."""
    return _SwiGLU.apply(gate_up)


# ----------------------------------------------------------------------------------- RMSNorm
def _norm_tile(n: int) -> tuple[int, int, int]:
    """(rows per tile, padded row length, warps) for rows of ``n`` elements."""
    block_n = _pow2(n)
    tile = launch_config().norm_tile
    block_m = _pow2(max(1, tile // block_n) + 1) // 2  # a power of two, rounded down
    warps = min(16, max(4, block_m * block_n // 512))
    return block_m, block_n, warps


def _norm_forward(x, residual, weight, eps):
    """-> (the normed rows' input ``[rows, n]`` to save, total or None, y, rstd)."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm weight of shape {tuple(weight.shape)} for rows of {n}")
    xs = _rows(x, n)
    rows = xs.shape[0]
    total = None
    if residual is None:
        source = xs
    else:
        if residual.shape != x.shape:
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)} vs residual "
                             f"{tuple(residual.shape)}")
        res = _rows(residual, n)
        total = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                            device=x.device)
        source = total.view(-1, n)
    y = torch.empty(x.shape, dtype=torch.promote_types(source.dtype, weight.dtype),
                    device=x.device)
    y2 = y.view(-1, n)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block_m, block_n, warps = _norm_tile(n)
    if rows and n:
        res_arg = res if residual is not None else xs
        _kernels().rms_norm_fwd_kernel[(-(-rows // block_m),)](
            xs, res_arg, source, weight.contiguous(), y2, rstd, rows, n, xs.stride(0),
            res_arg.stride(0), source.stride(0), y2.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps)
    return source, total, y, rstd


def _norm_backward(x, weight, rstd, d_total, d_y, need_dw: bool):
    """x ``[rows, n]`` (what was normed), -> (dx ``[rows, n]`` in x's dtype, dw or None)."""
    rows, n = x.shape
    dw = None
    if d_y is None:  # the normed output took no part in the loss
        dx = _rows(d_total, n).to(x.dtype)
        if need_dw:
            dw = torch.zeros_like(weight)
        return dx, dw
    dy = _rows(d_y, n)
    dt = _rows(d_total, n) if d_total is not None else None
    dx = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m, block_n, warps = _norm_tile(n)
    tiles = -(-rows // block_m)
    programs = max(1, min(tiles, _sm_count(x.device) * launch_config().norm_programs_per_sm))
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    if rows and n:
        dt_arg = dt if dt is not None else dy
        _kernels().rms_norm_bwd_kernel[(programs,)](
            x, weight.contiguous(), rstd, dy, dt_arg, dx, partial, rows, n, x.stride(0),
            dy.stride(0), dt_arg.stride(0), dx.stride(0), HAS_DT=dt is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    else:
        partial.zero_()
    if need_dw:
        dw = partial.sum(0).to(weight.dtype)
    return dx, dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        source, _, y, rstd = _norm_forward(x, None, weight, eps)
        ctx.save_for_backward(source, weight, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, d_y):
        source, weight, rstd = ctx.saved_tensors
        dx, dw = _norm_backward(source, weight, rstd, None, d_y, ctx.needs_input_grad[1])
        return dx.view(ctx.x_shape), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zeros)
        source, total, y, rstd = _norm_forward(x, residual, weight, eps)
        ctx.save_for_backward(source, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        ctx.x_shape = x.shape
        return total, y

    @staticmethod
    @once_differentiable
    def backward(ctx, d_total, d_y):
        if d_total is None and d_y is None:
            return None, None, None, None
        source, weight, rstd = ctx.saved_tensors
        d_sum, dw = _norm_backward(source, weight, rstd, d_total, d_y, ctx.needs_input_grad[2])
        d_sum = d_sum.view(ctx.x_shape)
        # the sum's gradient goes to both addends (the same tensor where the dtypes agree, as
        # the compiled path's backward returns it)
        dx, dres = (d_sum if dt == d_sum.dtype else d_sum.to(dt) for dt in ctx.dtypes)
        return dx, dres, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim (fp32 stats)."""
    return _RMSNorm.apply(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(x + residual, rms_norm(x + residual))`` in one pass each way."""
    return _AddRMSNorm.apply(x, residual, weight, eps)
