"""Exact mode on the GPU (bf16, TP=1): rollout log-probs == training log-probs bit for bit.

For a dense Llama (GQA, llama3 rope) and a Qwen3-MoE (16 experts top-4, qk-norm, one dense
layer), one batch is generated with continuous arrivals (``ContinuousEngine``, one request
submitted per step, n=2 samples sharing a prefill, lengths varying, decode buckets growing and
shrinking; dense: CUDA graphs) and scored by the actor's old-log-prob forward
(``PolicyRole.log_probs``) in microbatches of ~1, a few, and all sequences: every response
log-prob equals the rollout's exactly. The update's forward (with autograd) gives the same
bits, and its backward runs (finite gradients). The static engine (``generation.generate``,
CUDA graph per call) is held to the same. The normal-mode difference is printed beside.

    python -m pytest -q tests/gpu/test_exact_mode.py -s
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

DEV = "cuda"
BUDGETS = (64, 400, 1 << 20)  # microbatch tokens: ~1 sequence, a few, everything at once


@pytest.fixture(scope="module")
def exact_models(tmp_path_factory):
    from parallel_models.testing import save_tiny_hf_model

    root = tmp_path_factory.mktemp("exact_hf")
    common = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=1024)
    dense = save_tiny_hf_model(str(root / "llama"), "llama", seed=0, intermediate_size=1408,
                               num_hidden_layers=4, vocab_size=4099, **common)
    moe = save_tiny_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=0, intermediate_size=1024,
                             num_hidden_layers=4, num_experts=16, num_experts_per_tok=4,
                             moe_intermediate_size=256, mlp_only_layers=[1], vocab_size=4099,
                             **common)
    return {"llama": dense, "qwen3_moe": moe}


def _prompts(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4000, (int(n),), generator=g).tolist()
            for n in torch.randint(5, 90, (count,), generator=g)]


def _batch(out):
    return dict(sequences=out.sequences.to(DEV), attention_mask=out.attention_mask.to(DEV),
                prompt_lengths=out.prompt_mask.sum(-1).to(DEV),
                response_mask=out.response_mask.to(DEV))


def _continuous_rollout(model, prompts, max_new_tokens=40):
    from parallel_models.inference.continuous import ContinuousEngine, generation_output
    from parallel_models.inference.sampling import SamplingParams

    engine = ContinuousEngine(model, 4096, max_rows=8)
    reqs = []
    for i, p in enumerate(prompts):  # one arrival per step: buckets grow and shrink
        params = SamplingParams(temperature=1.0, ignore_eos=True, n=2, seed=11 + i,
                                max_new_tokens=max_new_tokens - 3 * (i % 7))
        reqs.append(engine.submit(p, params))
        engine.step()
    engine.run()
    return generation_output(reqs), engine


def _scored(model, batch, budgets=BUDGETS, temperature=1.0):
    from parallel_models.rl.roles.model_roles import PolicyRole

    return {b: PolicyRole(model, None, temperature=temperature, max_tokens=b).log_probs(batch)
            for b in budgets}


def _update_forward(model, batch, budget):
    """The update's forward (autograd on) of every microbatch -> log-probs [B, R]; backward."""
    from parallel_models.rl.roles.model_roles import _response_log_probs, make_microbatches
    from parallel_models.utils.microbatch import restore_order

    mbs, indices = make_microbatches(batch, budget)
    outs = []
    for mb in mbs:
        logits = model(mb["input_ids"].to(DEV), mb["cu_seqlens"].to(DEV),
                       mb["position_ids"].to(DEV), mb["max_seqlen"]).logits
        mb = {k: v.to(DEV) if torch.is_tensor(v) else v for k, v in mb.items()}
        logp, _ = _response_log_probs(logits, mb, 1.0, True)
        (logp * mb["response_mask"]).sum().backward()
        outs.append(logp.detach())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = bool(grads) and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)
    return restore_order(outs, indices), finite


def _check(name, rollout_logp, mask, scored):
    rollout = rollout_logp.to(DEV)[mask]
    for budget, logp in scored.items():
        got = logp.to(DEV)[mask]
        diff = (got - rollout).abs().max().item()
        assert torch.equal(got, rollout), f"{name}: microbatch {budget} tokens: max |diff| {diff}"


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_continuous_rollout_equals_training_bitwise(exact_models, single_rank, family):
    import parallel_models as pm
    from parallel_models.llama.layers.exact import exact_mode

    model = pm.AutoModelForCausalLM.from_pretrained(exact_models[family], rmpad=True,
                                                   dtype=torch.bfloat16)
    prompts = _prompts(12, seed=1)
    with exact_mode():
        out, engine = _continuous_rollout(model, prompts)
        batch = _batch(out)
        scored = _scored(model, batch)
        update_logp, finite = _update_forward(model, batch, 400)
    mask = out.response_mask.bool().to(DEV)
    assert int(mask.sum()) > 300
    normal = _scored(model, batch, (400,))[400].to(DEV)[mask]
    print(f"\n{family}: normal mode max |rollout - training| = "
          f"{(normal - out.log_probs.to(DEV)[mask]).abs().max().item():.3e}; exact mode: 0")
    _check(family, out.log_probs, mask, scored)
    _check(f"{family} update forward", out.log_probs, mask, {400: update_logp})
    assert finite, "the update's backward gave no or non-finite gradients"
    if family == "llama":  # the decode buckets ran as CUDA graphs of the exact kernels
        assert any(s.graph is not None and s.exact for s in engine._steps.values())


def test_static_generate_equals_training_bitwise(exact_models, single_rank):
    import parallel_models as pm
    from parallel_models.llama.layers.exact import exact_mode
    from parallel_models.inference.generation import generate
    from parallel_models.inference.sampling import SamplingParams

    model = pm.AutoModelForCausalLM.from_pretrained(exact_models["llama"], rmpad=True,
                                                   dtype=torch.bfloat16)
    prompts = _prompts(10, seed=2)
    params = SamplingParams(temperature=0.8, ignore_eos=True, max_new_tokens=32, seed=3)
    with exact_mode():
        out = generate(model, prompts, params)
        scored = _scored(model, _batch(out), temperature=0.8)
    mask = out.response_mask.bool().to(DEV)
    _check("static generate", out.log_probs, mask, scored)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_tp2_rollout_equals_training_bitwise(exact_models, family):
    """TP=2 (nccl; MoE trains with sequence parallel): the same check on every rank."""
    from parallel_models.testing import run_distributed
    from tests.helpers import exact_checks

    results = run_distributed(exact_checks.check_rollout_vs_training, 2, exact_models[family],
                              8, 24, tp=2, dtype="bfloat16", timeout=300)
    for r in results:
        assert r["tokens"] >= 100
        assert r["exact_diff"] == {16: None, 10_000: None}, r["exact_diff"]
        assert r["update_equal"]
