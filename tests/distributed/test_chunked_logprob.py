"""The token-chunked LM head + log-prob (``parallel_models/utils/chunked_logprob.py``) equals the
unchunked path (the head's logits, then ``vocab_parallel``): log-probs, entropy, loss and every
weight's gradient (through the hidden states, the whole model) on a packed batch of a tiny
checkpoint, in the same gloo ranks. TP = 1 and TP = 2 (with and without sequence parallel), an
untied head (Llama) and a tied one with a padded vocab slice (Qwen2, odd vocab at TP = 2), the
log-prob alone and with the entropy; float32 to rel <= 1e-6, bf16 to the bf16 tolerance of
tests/models/test_vocab_parallel.py. The model's output (``heads/lm_output.py``; under CP = 2
``ShardedCausalLMOutput``) takes the chunked path in the roles' log-prob path for more local
tokens than one chunk, without ever making the logits, with the same values and gradients."""

import pytest
import torch

from parallel_models.testing import run_named_jobs
from tests.helpers import chunked_logprob_checks as checks
from tests.helpers.vocab_parallel_checks import max_rel_error as _rel

FP32_TOL = 1e-6
BF16_TOL = 2e-2

# (name, family, TP, SP, with_entropy, chunk tokens, bf16, world)
# (TP = 1 with the entropy, untied: the cp1-llama case below, through the model's output)
HEAD_CASES = [("tp1-llama-logp", "llama", 1, False, False, 7, False, 1),
              ("tp1-llama-bf16", "llama", 1, False, True, 4, True, 1),
              ("tp1-llama-one-chunk", "llama", 1, False, True, 1000, False, 1),
              ("tp2-llama", "llama", 2, False, True, 4, False, 2),
              ("tp2sp-llama", "llama", 2, True, True, 3, False, 2),
              ("tp2-qwen2-tied", "qwen2", 2, False, True, 5, False, 2)]


@pytest.fixture(scope="module")
def results(hf_models):
    named = [(name, world, (checks.head_parity, (hf_models[(family, "causal_lm")], tp, sp, ent,
                                                 chunk, bf16)))
             for name, family, tp, sp, ent, chunk, bf16, world in HEAD_CASES]
    llama = hf_models[("llama", "causal_lm")]
    named += [("cp2-llama", 2, (checks.cp_parity, (llama, 1, 2))),
              ("cp1-llama", 1, (checks.cp_parity, (llama, 1, 1))),
              ("cp1-tp2sp-llama", 2, (checks.cp_parity, (llama, 2, 1, True)))]
    return run_named_jobs(named, timeout=600)


def _compare(plain: dict, chunked: dict, tol: float, where: str) -> None:
    for key in ("logp", "entropy", "loss"):
        if plain[key] is None:
            assert chunked[key] is None, (where, key)
            continue
        assert _rel(chunked[key], plain[key]) <= tol, (where, key)
    assert set(chunked["grads"]) == set(plain["grads"]), where
    for key, want in plain["grads"].items():
        assert want.abs().max() > 0, (where, key)  # every weight takes part in the loss
        assert _rel(chunked["grads"][key], want) <= tol, (where, key)


@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda c: c[0])
def test_chunked_head_equals_unchunked(results, case):
    name, family, tp, _, with_entropy, _, bf16, world = case
    ranks = results[name]
    assert len(ranks) == world
    for rank, r in enumerate(ranks):
        where = f"{name} rank {rank}"
        assert r["tied"] == (family == "qwen2"), where
        _compare(r["plain"], r["chunked"], BF16_TOL if bf16 else FP32_TOL, where)
        assert (r["chunked"]["entropy"] is None) == (not with_entropy), where
        if name.endswith("one-chunk"):  # one chunk: the same GEMMs, bit for bit
            assert r["bitwise"] == {"logp": True, "grads": True}, where


@pytest.mark.parametrize("name", ["cp2-llama", "cp1-llama", "cp1-tp2sp-llama"])
def test_model_output_log_probs_chunked(results, name):
    """The model's output for more tokens than one chunk (CP = 2: each rank's 16 tokens; CP = 1:
    the 31 tokens, at TP = 2 with sequence parallel and a padding row too): chunks of 5 give the
    unchunked run's log-probs, entropy, loss and gradients, and the logits are never made (read
    afterwards, they equal the eager head's); with one chunk the head runs as before (CP = 1:
    the eager logits, no lazy output)."""
    for rank, r in enumerate(results[name]):
        where = f"{name} rank {rank}"
        plain, chunked = r["plain"], r["chunked"]
        assert chunked["local_tokens"] > 5, where
        assert chunked["lazy"] and not chunked["logits_made"] and plain["logits_made"], where
        assert plain["lazy"] == name.startswith("cp2"), where
        _compare(plain, chunked, FP32_TOL, where)
        assert torch.equal(chunked["logits"], plain["logits"]), where
