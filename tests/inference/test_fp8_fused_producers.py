"""The hook that lets an FP8 rollout's norms and SwiGLU write e4m3 copies of their outputs
(``llama/layers/fused_ops.set_output_quantizer``, ``inference/fp8/fused_producers``), on the
CPU (the kernels themselves: tests/inference/test_fp8_producer_kernels.py, tests/gpu): which
ops go to an installed quantizer and which never do (exact mode, Gemma's unit offset), when the
FP8 rollout's quantizer wants an op (a channel-scaled Fp8Linears generating, the TMA decode
kernel, CUDA decode rows), and the scope of ``Fp8Linears.enabled``."""

import pytest
import torch

from parallel_models.inference.fp8 import fused_producers, gemm
from parallel_models.llama.layers import exact, fused_ops


class _Recording:
    """A quantizer that wants everything and marks its outputs."""

    def __init__(self):
        self.calls = []

    def wanted(self, *tensors):
        return True

    def rms_norm(self, x, residual, weight, eps):
        self.calls.append("add_rms_norm" if residual is not None else "rms_norm")
        total = None if residual is None else x + residual
        return total, torch.full_like(x, 7.0)

    def swiglu(self, gate_up):
        self.calls.append("swiglu")
        return torch.full_like(gate_up[..., : gate_up.shape[-1] // 2], 7.0)


@pytest.fixture
def recording():
    quantizer = _Recording()
    fused_ops.set_output_quantizer(quantizer)
    try:
        yield quantizer
    finally:
        fused_ops.set_output_quantizer(fused_producers.QUANTIZER)


def test_the_installed_quantizer_takes_the_norms_and_swiglu(recording):
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.ones(16)
    assert (fused_ops.rms_norm(x, w, 1e-5) == 7).all()
    total, y = fused_ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r) and (y == 7).all()
    assert (fused_ops.gated_activation(torch.randn(3, 32), "silu") == 7).all()
    assert recording.calls == ["rms_norm", "add_rms_norm", "swiglu"]


def test_exact_mode_and_the_unit_offset_never_go_to_it(recording, monkeypatch):
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.ones(16)
    fused_ops.rms_norm(x, w, 1e-5, unit_offset=True)
    fused_ops.add_rms_norm(x, r, w, 1e-5, unit_offset=True)
    from parallel_models.llama.layers.exact import ops

    monkeypatch.setattr(exact, "enabled", lambda: True)  # (exact mode's kernels need triton)
    monkeypatch.setattr(ops, "rms_norm", lambda x, w, eps, reference: reference(x, w, eps))
    fused_ops.rms_norm(x, w, 1e-5)
    fused_ops.add_rms_norm(x, r, w, 1e-5)
    fused_ops.swiglu(torch.randn(3, 32))
    assert recording.calls == []
    monkeypatch.setattr(exact, "enabled", lambda: False)
    fused_ops.set_output_quantizer(None)  # none installed: the ops as before
    assert torch.allclose(fused_ops.rms_norm(x, w, 1e-5), fused_ops._rms_norm(x, w, 1e-5))


class _State:
    def __init__(self, granularity):
        self.granularity = granularity


def test_the_fp8_quantizer_wants_ops_only_while_a_channel_rollout_generates(monkeypatch):
    monkeypatch.setattr(gemm, "DECODE_KERNEL", "tma")
    wanted = fused_producers.QUANTIZER.wanted
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    channel, block = _State("channel"), _State("block")
    assert not fused_producers._active
    with fused_producers.tracking(block):
        assert not fused_producers._active  # (block weights: no TMA kernel, no copies)
    with fused_producers.tracking(channel):
        with fused_producers.tracking(channel):  # nested: still on after the inner one
            assert channel in fused_producers._active
        assert channel in fused_producers._active
        assert not wanted(x)  # a CPU tensor: the kernels are CUDA's
    assert channel not in fused_producers._active
    assert not wanted(x)


def test_enabled_scopes_the_tracking():
    from megatron.core import parallel_state  # noqa: F401  (the rollout model's linears)

    from parallel_models.inference.fp8.rollout_linears import Fp8Linears

    class _Fake(Fp8Linears):
        def __init__(self, granularity):  # (no model: only the scope is under test)
            self.granularity, self.active, self.stale = granularity, False, False

    fp8 = _Fake("channel")
    with fp8.enabled():
        assert fp8.active and fp8 in fused_producers._active
    assert not fp8.active and fp8 not in fused_producers._active
