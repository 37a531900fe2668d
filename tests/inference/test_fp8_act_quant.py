"""The FP8 rollout's activation quantization kernels (``inference/fp8/act_quant_kernel.py``: per
token and 128-wide group, and per token) in Triton's CPU interpreter (on CUDA where present)
against ``quantize.quantize_activation``, bit for bit: the same scales and e4m3 values, on bf16
activations that land on e4m3 ties, rows wider than one step of the per-token kernel and not a
multiple of it (held whole in registers, and wider than that: the two-pass kernel), all-zero
rows and groups. Skipped without triton (not a dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.fp8 import act_quant_kernel  # noqa: E402
from parallel_models.inference.fp8.quantize import quantize_activation  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _activations(tokens, cols):
    """bf16 values of magnitude 1/2..7/4 (no e4m3 subnormals after scaling: the interpreter's
    stand-in rounding is checked on normals) with random signs; a group of every row holds a
    value that makes x / scale an exact e4m3 tie for many others (amax 1.75 -> scale 1.75/448)."""
    g = torch.Generator().manual_seed(tokens * 31 + cols)
    mag = 0.5 + 1.25 * torch.rand(tokens, cols, generator=g)  # (<= 1.75: the amax below)
    x = (mag * torch.sign(torch.randn(tokens, cols, generator=g))).bfloat16()
    x[::2, ::128] = 1.75  # (odd rows: their own amax, a scale that is no power of two)
    if tokens > 2:
        x[2] = 0  # an all-zero row: scale 1, zeros
    if cols > 256:
        x[0, 128:256] = 0  # an all-zero group
    return x.to(DEV)


@pytest.mark.parametrize("tokens,cols", [(1, 128), (5, 300), (3, 2048),
                                         (4, act_quant_kernel.TOKEN_BLOCK + 77),
                                         (3, act_quant_kernel.WHOLE_ROW_COLS + 77)])
def test_per_token_kernel_equals_the_recipe(tokens, cols):
    x = _activations(tokens, cols)
    q, s = act_quant_kernel.quantize_tokens(x)
    q_ref, s_ref = quantize_activation(x, "channel")
    assert s.shape == (tokens, 1) and torch.equal(s[:, 0], s_ref)
    assert torch.equal(q.float(), q_ref.float())
    if tokens > 2:
        assert float(s[2]) == 1.0 and not q[2].float().any()


@pytest.mark.parametrize("tokens,cols", [(1, 128), (5, 300), (6, 640)])
def test_per_group_kernel_equals_the_recipe(tokens, cols):
    x = _activations(tokens, cols)
    q, s = act_quant_kernel.quantize_token_groups(x)
    q_ref, s_ref = quantize_activation(x, "block")
    assert s.stride(0) == 1 and torch.equal(s, s_ref)  # token-major, as _scaled_mm reads
    assert torch.equal(q.float(), q_ref.float())


def test_ties_are_where_the_recipe_rounds_them():
    """The data does land on exact e4m3 ties (so the tests above would see a kernel that rounds
    them another way: 1.75 / 448 is 2^-8, and bf16 values times 2^8 keep bf16's 7 mantissa bits,
    1 in 16 of them halfway between two e4m3 values), and the kernel rounds them half to even
    as torch does."""
    x = _activations(3, 2048)
    _, s = quantize_activation(x, "channel")
    scaled = (x.float() * torch.reciprocal(s)[:, None]).cpu()
    bits = scaled.abs().view(torch.int32)
    # halfway: exact with 4 mantissa bits (fp32's low 19 zero), not with e4m3's 3 (low 20 not)
    ties = ((bits & 0x7FFFF) == 0) & ((bits & 0xFFFFF) != 0) & (scaled.abs() >= 2.0 ** -6)
    assert int(ties.sum()) > 100
    q, _ = act_quant_kernel.quantize_tokens(x)
    assert torch.equal(q.float().cpu(), scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_gaussian_bf16_activations_round_like_the_recipe(granularity):
    """Plain bf16 Gaussian activations over their own amax: x * (1 / scale) lands on e4m3 ties
    that x / scale does not (about 5 in 10^4 elements, one e4m3 step apart): a kernel that
    divides fails here."""
    cols = 8192 if granularity == "channel" else 2048  # (the group kernel: a program a group)
    x = torch.randn(16, cols, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEV)
    quantize = (act_quant_kernel.quantize_tokens if granularity == "channel"
                else act_quant_kernel.quantize_token_groups)
    q, s = quantize(x)
    q_ref, s_ref = quantize_activation(x, granularity)
    assert torch.equal(s.reshape(s_ref.shape), s_ref)
    assert torch.equal(q.float(), q_ref.float())
