"""``rollout.engine.all_finite`` (the fast NaN/inf check of a weight update) agrees with
``torch.isfinite(t).all()`` for every float dtype, NaN/inf at any position, and empty tensors."""

import pytest
import torch

from parallel_models.inference.engine import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_matches_isfinite(dtype):
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 64, 1001):
        clean = torch.randn(n, generator=g).to(dtype)
        assert all_finite(clean) and bool(torch.isfinite(clean).all())
        for bad in (float("nan"), float("inf"), -float("inf")):
            for pos in {0, n // 2, n - 1}:
                t = clean.clone()
                t[pos] = bad
                assert not all_finite(t) and not bool(torch.isfinite(t).all())
    assert all_finite(torch.empty(0, 3, dtype=dtype))
    big = torch.full((4, 5), 6e4 if dtype == torch.float16 else 3e38).to(dtype)
    assert all_finite(big) == bool(torch.isfinite(big).all())  # large but finite
