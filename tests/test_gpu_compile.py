"""``utils.gpu_compile``: one compiled variant per input kind, so no op hits dynamo's recompile limit.

Run on the CPU with dynamo's ``eager`` backend (the same guards and recompile limit as inductor
on CUDA, without a compiler): the 8B PPO + LoRA-critic run called the RMSNorm with more input
kinds than dynamo's limit of 8 compiled entries per code object, and every later call failed over
to eager after re-checking all 8 (113,022 logged failures in one run).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from parallel_models.utils.gpu_compile import PerVariantCompile, variant_key


def _rms_norm(x, weight, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _variants():
    """16 input kinds: grad mode x input requires_grad x weight requires_grad x dtype."""
    for grad, x_grad, w_grad, dtype in itertools.product(
            (True, False), (True, False), (True, False), (torch.float32, torch.float64)):
        x = torch.randn(3, 8, dtype=dtype, generator=torch.Generator().manual_seed(0))
        w = torch.linspace(0.5, 1.5, 8, dtype=dtype)
        yield grad, x.requires_grad_(x_grad), w.requires_grad_(w_grad)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_one_shared_compile_hits_the_limit_the_per_variant_one_does_not():
    shared = torch.compile(_rms_norm, fullgraph=True, backend="eager")
    per_variant = PerVariantCompile(_rms_norm, backend="eager")
    limit_hit = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no recompile-limit warning from ours
        for grad, x, w in _variants():
            with torch.set_grad_enabled(grad):
                want = _rms_norm(x, w, 1e-6)
                got = per_variant(x, w, 1e-6)
                try:
                    shared(x, w, 1e-6)
                except torch._dynamo.exc.FailOnRecompileLimitHit:
                    limit_hit += 1
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert got.requires_grad == want.requires_grad
    assert limit_hit > 0, "the shared compile was expected to exceed dynamo's recompile limit"
    assert len(per_variant.compiled) == 16
    assert all(fn is not _rms_norm for fn in per_variant.compiled.values())


def test_views_and_numbers_in_the_key():
    x = torch.randn(4, 8)
    assert variant_key((x, 1e-6)) == variant_key((torch.randn(2, 8), 1e-5))  # shape, eps: dynamo's
    assert variant_key((x[1:], 1e-6)) != variant_key((x, 1e-6))  # a view
    assert variant_key((x, True)) != variant_key((x, False))
    with torch.no_grad():
        without_grad = variant_key((x,))
    assert variant_key((x,)) != without_grad


def test_a_variant_over_the_limit_runs_eagerly_without_calling_dynamo_again(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)
    per_variant = PerVariantCompile(_rms_norm, backend="eager")
    w = torch.ones(8)
    with pytest.warns(UserWarning, match="recompile limit"):
        for rows in (2, 3, 4):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(per_variant(x, w, 1e-6), _rms_norm(x, w, 1e-6))
    (fn,) = per_variant.compiled.values()
    assert fn is _rms_norm  # from now on eager: no guard checks, no exception, no log
    x = torch.randn(5, 8)
    torch.testing.assert_close(per_variant(x, w, 1e-6), _rms_norm(x, w, 1e-6))
