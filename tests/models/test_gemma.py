"""Gemma (the family added through ``parallel_models/llama/families/gemma.py``) against
transformers' GemmaForCausalLM / GemmaForSequenceClassification on the same weights: (1 + w)
RMSNorm in fp32, gated GELU-tanh MLP, embeddings scaled by sqrt(hidden) in the hidden dtype, tied
embeddings, head_dim 24 != hidden / heads. fp32 logits and values at TP=1, TP=2 and TP=2 + SP,
padded and RmPad, left and right padding (max abs <= 1e-4); gradients of one cross-entropy
backward at TP=2 and TP=2 + SP (relative <= 1e-4); greedy generation with the KV cache (the
decode path fuses each residual add into the next (1 + w) norm) == transformers.generate at TP=1
and TP=2 + SP; a bf16 forward at TP=1 (the dtype casts)."""

import pytest
import torch

from parallel_models.testing import run_named_jobs, save_tiny_hf_model
from tests.helpers import generation_checks, model_checks

FWD_TOL = 1e-4
SETTINGS = {"tp1": (1, False, 1), "tp2": (2, False, 2), "tp2_sp": (2, True, 2)}
GRADIENTS = [(2, False), (2, True)]
GENERATION = [(1, False), (2, True)]


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {("gemma", head): save_tiny_hf_model(str(root / head), "gemma", head=head, seed=5)
            for head in ("causal_lm", "value")}


@pytest.fixture(scope="module")
def worlds(gemma_models):
    named = [(("forward", name), world, (model_checks.check_forward, (gemma_models, tp, sp)))
             for name, (tp, sp, world) in SETTINGS.items()]
    named += [(("gradients", tp, sp), tp,
               (model_checks.check_gradients, (gemma_models, tp, sp), dict(families=("gemma",))))
              for tp, sp in GRADIENTS]
    named += [(("generation", tp, sp), tp, (generation_checks.check_generation,
                                            (gemma_models[("gemma", "causal_lm")], tp, sp)))
              for tp, sp in GENERATION]
    return run_named_jobs(named, timeout=900)


KEYS = [f"gemma-{head}-{layout}-{side}" for head in ("causal_lm", "value")
        for layout in ("padded", "rmpad") for side in ("left", "right")]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_gemma_forward_matches_transformers(worlds, setting):
    for rank, res in enumerate(worlds[("forward", setting)]):
        for key in KEYS:
            err = res["errors"][key]
            assert err <= FWD_TOL, f"{setting} rank {rank} {key}: max abs error {err:.3e}"
        if setting != "tp1":
            err = res["errors"]["gemma-causal_lm-padded-right-vocab-slice"]
            assert err <= FWD_TOL, f"{setting} rank {rank} vocab slice: {err:.3e}"


@pytest.mark.parametrize("tp,sp", GRADIENTS)
def test_gemma_gradients_match_transformers(worlds, tp, sp):
    for rank, res in enumerate(worlds[("gradients", tp, sp)]):
        assert res["gemma"]["worst_rel"] <= 1e-4, (
            f"rank {rank}: grad rel error {res['gemma']['worst_rel']:.3e}")


@pytest.mark.parametrize("tp,sp", GENERATION)
def test_gemma_generation_matches_transformers(worlds, tp, sp):
    ranks = worlds[("generation", tp, sp)]
    for r in ranks:
        assert r["greedy_mismatches"] == [], \
            f"greedy differs from transformers for prompts {r['greedy_mismatches']}"
        assert r["logp_err"] <= 1e-4, f"sampling log-probs vs fresh forward: {r['logp_err']:.2e}"
        assert torch.equal(r["responses"], ranks[0]["responses"]), "TP ranks drew different tokens"


def test_gemma_bf16_forward_matches_transformers(tmp_path):
    """bf16 at TP=1 in-process: the scaled embedding equals transformers' bit for bit (the scale
    cast to bf16 as HF does); the logits agree to a few bf16 steps (max abs <= 1e-2 on logits
    of size ~1.5; the matmuls' summation order differs)."""
    import parallel_models as pm
    from transformers import AutoModelForCausalLM

    path = save_tiny_hf_model(str(tmp_path / "bf16"), "gemma", seed=6, dtype=torch.bfloat16)
    pm.init_parallel(tensor_parallel_size=1)
    try:
        model = pm.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        assert type(model).__name__ == "GemmaForCausalLM"
        assert model.config.norm_unit_offset and model.config.hidden_act == "gelu_pytorch_tanh"
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator()
                            .manual_seed(0))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            ours = model(ids, attention_mask=mask, full_vocab=True).logits.float()
            ref = hf(input_ids=ids, attention_mask=mask).logits.float()
        err = (ours - ref).abs().max().item()
        assert err <= 1e-2, f"bf16 max abs error {err:.3e}"
        with torch.no_grad():
            emb = model.model.embed(ids[0]).squeeze(1)
            assert torch.equal(emb, hf.model.embed_tokens(ids[:1])[0])
    finally:
        pm.destroy_parallel()
