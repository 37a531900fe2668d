"""parallel_models.utils.vocab_parallel: log-probs / entropy from vocab-parallel logits.

The TP=2 checks run in ONE spawned run (tests/helpers/vocab_parallel_checks.py) shared by the tests
below; the rest is single-process math (TP=1 fallback, no torch.distributed).
"""

import pytest
import torch

from parallel_models.testing import run_distributed
from parallel_models.utils.vocab_parallel import (gather_response, log_probs_from_packed_logits,
                                                  packed_next_token_mask, response_mask,
                                                  vocab_parallel_entropy, vocab_parallel_log_probs,
                                                  vocab_parallel_log_probs_and_entropy)
from tests.helpers import vocab_parallel_checks

FP32_TOL = 1e-5
BF16_TOL = 2e-2


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(vocab_parallel_checks.run_all_checks, 2, timeout=120)


def _check(results, prefix, tol):
    seen = 0
    for rank, res in enumerate(results):
        for key, err in res.items():
            if key.startswith(prefix + "/") and not key.endswith(("dtypes_ok", "pad_grad_abs")):
                seen += 1
                assert err <= tol, f"rank {rank} {key}: rel error {err:.3e} > {tol:.0e}"
    assert seen, f"no results for {prefix}"


@pytest.mark.parametrize("case,tol", [("fp32", FP32_TOL), ("padded_fp32", FP32_TOL),
                                      ("bf16", BF16_TOL), ("padded_bf16", BF16_TOL)])
def test_tp2_matches_full_vocab(tp2_results, case, tol):
    """Values and gradients of log-probs, entropy and both together equal log_softmax/entropy
    over the all-gathered logits (random labels, incl. slice edges; vocab 257 padded to 258)."""
    _check(tp2_results, case, tol)
    for res in tp2_results:
        assert res[f"{case}/dtypes_ok"] == 1.0, "outputs must be float32, grads the input dtype"
        if case.startswith("padded"):
            assert res[f"{case}/pad_grad_abs"] == 0.0


def test_tp2_packed_next_token_log_probs(tp2_results):
    """RmPad helper vs a per-sequence loop (lengths 6, 1, 0, 9, 4), entropy and gradients too;
    and gather_response end to end vs the padded [B, R] reference."""
    _check(tp2_results, "packed", FP32_TOL)
    _check(tp2_results, "response", FP32_TOL)


def test_tp2_with_parallel_lm_head(tp2_results):
    """The real ParallelLMHead (padding row = finfo.min) -> values and hidden-state gradients."""
    _check(tp2_results, "lm_head", FP32_TOL)


# ---- single process (TP=1 fallback, no torch.distributed) -----------------------------------

def _ref(z, labels):
    logp = torch.log_softmax(z.double(), -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_local_fallback_matches_log_softmax():
    assert not torch.distributed.is_initialized()
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 5, 33, generator=g) * 4
    y = torch.randint(0, 33, (4, 5), generator=g)
    lp, ent = vocab_parallel_log_probs_and_entropy(z, y)
    rlp, rent = _ref(z, y)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vocab_parallel_log_probs(z, y), lp)
    torch.testing.assert_close(vocab_parallel_entropy(z), ent)


@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
def test_gradcheck_float64(which):
    """The analytic backward (onehot - p; -p (z - E_p z)) against finite differences."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 2, 9, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 9, (3, 2), generator=g)
    fn = {"both": lambda x: vocab_parallel_log_probs_and_entropy(x, y),
          "logp": lambda x: vocab_parallel_log_probs(x, y),
          "entropy": vocab_parallel_entropy}[which]
    assert torch.autograd.gradcheck(fn, (z,))


@pytest.mark.parametrize("which", ["both", "logp"])
def test_temperature_divides_after_the_upcast(which):
    """``temperature``: log-probs / entropy of ``softmax(float32(logits) / T)`` (what the sampler
    draws from), not of bf16-rounded ``logits / T`` (which is off by up to ~|z| 2^-9, i.e. 1e-2 at
    |z| ~ 10); gradients match autograd through that float32 math (and gradcheck in float64)."""
    g = torch.Generator().manual_seed(5)
    z = (torch.randn(64, 257, generator=g) * 6).to(torch.bfloat16)
    y = torch.randint(0, 257, (64,), generator=g)
    t = 0.7
    ref = z.float().requires_grad_()
    rlp, rent = _ref(ref / t, y)
    rlp, rent = rlp.float(), rent.float()
    x = z.clone().requires_grad_()
    if which == "both":
        lp, ent = vocab_parallel_log_probs_and_entropy(x, y, temperature=t)
        torch.testing.assert_close(ent, rent, rtol=0, atol=2e-5)
        loss, rloss = lp.sum() + 0.3 * ent.sum(), rlp.sum() + 0.3 * rent.sum()
    else:
        lp = vocab_parallel_log_probs(x, y, temperature=t)
        loss, rloss = lp.sum(), rlp.sum()
    torch.testing.assert_close(lp, rlp, rtol=0, atol=2e-5)
    rounded, _ = _ref((z / t).float(), y)  # the old way: divide the bf16 logits
    assert (rounded.float() - rlp).abs().max() > 1e-3  # so the check above can tell them apart
    loss.backward()
    rloss.backward()
    torch.testing.assert_close(x.grad.float(), ref.grad, rtol=1e-2, atol=1e-3)
    z64 = torch.randn(3, 9, generator=g, dtype=torch.float64, requires_grad=True)
    y64 = torch.randint(0, 9, (3,), generator=g)
    assert torch.autograd.gradcheck(
        lambda v: vocab_parallel_log_probs_and_entropy(v, y64, temperature=t), (z64,))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(z, y, temperature=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_min_and_inf_logits_are_safe(dtype):
    """finfo.min (padding rows) and -inf (banned tokens) logits: p = 0, zero gradient, no NaN."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 8, generator=g).to(dtype)
    z[:, -1] = torch.finfo(dtype).min
    z[0, 3] = float("-inf")
    z.requires_grad_()
    lp, ent = vocab_parallel_log_probs_and_entropy(z, torch.tensor([1, 3]))
    # upstream grads > 1 in magnitude: (z - E) * g at a finfo.min row must not overflow
    (lp * torch.tensor([-3.0, 7.0])).sum().add((ent * torch.tensor([5.0, -9.0])).sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(z.grad).all()
    assert (z.grad[:, -1] == 0).all() and z.grad[0, 3] == 0
    rlp, rent = _ref(z.detach().float()[:, :-1], torch.tensor([1, 3]))
    ent_ref = torch.nan_to_num(rent, nan=0.0)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(lp.double(), rlp, rtol=tol, atol=tol)
    # the reference entropy is NaN where a logit is -inf (0 * -inf); compare the finite row
    torch.testing.assert_close(ent[1].double(), ent_ref[1], rtol=tol, atol=tol)


def test_does_not_modify_input_and_rejects_bad_shapes():
    z = torch.randn(3, 10)
    before = z.clone()
    vocab_parallel_log_probs_and_entropy(z, torch.tensor([0, 5, 9]))
    assert torch.equal(z, before)
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_log_probs(z, torch.tensor([0, 1]))
    with pytest.raises(TypeError):
        vocab_parallel_log_probs(z, torch.tensor([0.0, 1.0, 2.0]))


def test_packed_next_token_mask():
    cu = torch.tensor([0, 3, 3, 4, 7], dtype=torch.int32)  # lengths 3, 0, 1, 3
    assert packed_next_token_mask(cu).tolist() == [True, True, False, False, True, True, False]
    # trailing padding beyond cu_seqlens[-1] (e.g. for sequence parallelism) is masked too
    assert packed_next_token_mask(cu, 9).tolist()[7:] == [False, False]
    # a leading empty sequence, ends past a shorter ``total``: the definition token by token
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        lens = torch.randint(0, 4, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
        for total in (int(cu[-1]), int(cu[-1]) + 2, max(int(cu[-1]) - 2, 0)):
            want = [any(int(cu[b]) <= t < int(cu[b + 1]) - 1 for b in range(len(lens)))
                    for t in range(total)]
            assert packed_next_token_mask(cu, total).tolist() == want, (cu.tolist(), total)


def test_log_probs_from_packed_logits_local():
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    z = torch.randn(9, 17, generator=g)
    ids = torch.randint(0, 17, (9,), generator=g)
    lp = log_probs_from_packed_logits(z, ids, cu)
    want = torch.zeros(9)
    for b in range(3):
        for t in range(int(cu[b]), int(cu[b + 1]) - 1):
            want[t] = torch.log_softmax(z[t], -1)[ids[t + 1]]
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-6)


def test_gather_response_layout_mask_and_grad():
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)  # lengths 5, 3, 6
    prompts = [2, 3, 1]  # responses 3, 0, 5
    vals = torch.arange(14, dtype=torch.float32).requires_grad_()
    out = gather_response(vals, cu, prompts, 5, fill_value=-1.0)
    assert out.tolist() == [[1, 2, 3, -1, -1], [-1] * 5, [8, 9, 10, 11, 12]]
    out0 = gather_response(vals, cu, torch.tensor(prompts), 5, shift=0)
    assert out0.tolist() == [[2, 3, 4, 0, 0], [0] * 5, [9, 10, 11, 12, 13]]
    assert response_mask(cu, prompts, 5).tolist() == [[True] * 3 + [False] * 2, [False] * 5,
                                                      [True] * 5]
    out.sum().backward()
    assert vals.grad.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0]
    # trailing dims are carried
    two = gather_response(torch.stack([vals, -vals], -1).detach(), cu, prompts, 5)
    assert two.shape == (3, 5, 2) and two[2, 0].tolist() == [8, -8]
    with pytest.raises(ValueError, match="sequence 2"):
        gather_response(vals, cu, prompts, 4)  # response of 5 > 4
    with pytest.raises(ValueError, match="shift"):
        gather_response(vals, cu, [0, 3, 1], 5)  # no token before the first response token
    with pytest.raises(ValueError, match="entries"):
        gather_response(vals, cu, [1, 1], 5)
