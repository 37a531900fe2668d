"""The FP8 activation recipe's e4m3 rounding in Triton kernels.

- :func:`round_to_e4m3`: fp32 -> the nearest e4m3 value (round half to even), as fp32, with
  integer ops on the fp32 bits: the CPU interpreter's stand-in for the hardware conversion, which
  the interpreter gets wrong (no carry into the exponent, subnormals cut). The FP8 decode GEMM
  (``dynamic_act_kernel``), the activation quantization (``act_quant_kernel``) and the split-KV
  attention's FP8 KV pool (``split_kv_kernels``) quantize through it when interpreted, so the
  CPU tests check the same rounding the GPU does.
- :func:`e4m3_scale` and :func:`scaled_for_e4m3`: ``quantize.quantize_activation``'s recipe,
  ``scale = amax / 448`` (1 for an all-zero group) and ``clamp(x * (1 / scale))`` (the division
  and the reciprocal correctly rounded: Triton's ``/`` is approximate, and a division rounds the
  exact e4m3 ties of bf16 values apart from the reciprocal's product), shared by the activation
  quantization and the FP8 KV store.
"""

import triton
import triton.language as tl

# fp32 bits: e4m3 keeps 3 of fp32's 23 mantissa bits (20 dropped: round half to even, then cut);
# its normals start at 2^-6 (fp32 bits 0x3C800000); its subnormals are multiples of 2^-9, which
# (|v| + 2^14) - 2^14 rounds to in fp32 (the ulp at 2^14 is 2^-9)
DROPPED_BITS = 20
ROUND_HALF: tl.constexpr = tl.constexpr((1 << (DROPPED_BITS - 1)) - 1)
KEEP_BITS: tl.constexpr = tl.constexpr(-(1 << DROPPED_BITS))  # (~0xFFFFF as an int32)
ODD_BIT: tl.constexpr = tl.constexpr(DROPPED_BITS)
E4M3_MIN_NORMAL_BITS: tl.constexpr = tl.constexpr(0x3C800000)
SUBNORMAL_SHIFTER: tl.constexpr = tl.constexpr(16384.0)
SIGN_BIT: tl.constexpr = tl.constexpr(-(1 << 31))  # (0x80000000 as an int32: -0 stays -0)


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value (ties to even), as fp32: the
    interpreter's stand-in for the hardware conversion."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + ROUND_HALF + ((bits >> ODD_BIT) & 1)) & KEEP_BITS).to(tl.float32,
                                                                            bitcast=True)
    tiny = (tl.abs(v) + SUBNORMAL_SHIFTER) - SUBNORMAL_SHIFTER
    tiny = (tiny.to(tl.int32, bitcast=True) | (bits & SIGN_BIT)).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7FFFFFFF) >= E4M3_MIN_NORMAL_BITS, normal, tiny)


@triton.jit
def e4m3_scale(amax, FP8_MAX: tl.constexpr):
    """fp32 scale of values whose absolute maximum is ``amax``: ``amax / FP8_MAX``, 1 where
    ``amax`` is 0."""
    return tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)


@triton.jit
def scaled_for_e4m3(x, scale, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``x`` times the correctly rounded reciprocal of ``scale``, clamped to +-``FP8_MAX``:
    the values to store as e4m3 (``EMULATE``, the interpreter: already rounded to e4m3
    values)."""
    q = x * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if EMULATE:
        q = round_to_e4m3(q)
    return q


@triton.jit
def quantize_and_store(x, q_ptrs, mask, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``x`` (a token's values, or a group of them; 0 where not ``mask``) stored to
    ``q_ptrs`` as e4m3 with one scale, :func:`e4m3_scale` of their absolute maximum, which is
    returned."""
    amax = tl.max(tl.abs(x), axis=0)
    scale = e4m3_scale(amax, FP8_MAX)
    q = scaled_for_e4m3(x, scale, FP8_MAX, EMULATE)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)
    return scale


__all__ = ["e4m3_scale", "quantize_and_store", "round_to_e4m3", "scaled_for_e4m3"]
