"""Triton's CPU interpreter held to the GPU's bf16 rounding: Triton 3.6's interpreter converts
fp32 -> bf16 by dropping bits (or rounds half away from zero); the GPU rounds to nearest even,
like PyTorch. :func:`bf16_rounds_to_nearest_even` makes the interpreter use torch's conversion
inside it, so tests of kernels that round to bf16 check the GPU's roundings on the CPU."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def bf16_rounds_to_nearest_even():
    """Inside: the interpreter's fp32 -> bf16 conversions round to nearest even (a no-op off
    the interpreter)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            out = torch.from_numpy(np.ascontiguousarray(data).view(np.float32)).bfloat16()
            return out.view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original
