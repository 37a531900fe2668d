"""The continuous-batching engine on CUDA: fp32 greedy equals ``transformers.generate`` with
staggered arrivals; bf16 (flash decoding from the KV pool, one CUDA graph per bucket) gives the
same tokens as the same engine decoding eagerly, and its log-probs stay within bf16 tolerance of
a fresh forward pass."""

from __future__ import annotations

import pytest
import torch

DEV = "cuda"


def _prompts(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 40, (count,), generator=g)]


def _staggered(engine, prompts, params):
    """Submit one prompt per step (buckets grow and shrink as rows come and go); run out."""
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(engine.submit(p, params.model_copy(
            update={"max_new_tokens": params.max_new_tokens - i % 5})))
        engine.step()
    engine.run()
    return [r.samples[0] for r in reqs]


def test_fp32_staggered_equals_transformers(gpu_models, single_rank):
    import parallel_models as pm
    from transformers import AutoModelForCausalLM

    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    path = gpu_models["llama"]
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEV)
    prompts = _prompts(12)
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=16)
    samples = _staggered(ContinuousEngine(model, 256, max_rows=6), prompts, params)
    for p, s in zip(prompts, samples):
        ids = torch.tensor([p], device=DEV)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=len(s.token_ids), pad_token_id=0)
        assert ref[0, len(p):].tolist() == s.token_ids


def test_bf16_graphs_equal_eager_and_logprobs(gpu_models, single_rank, monkeypatch):
    import parallel_models as pm

    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    model = pm.AutoModelForCausalLM.from_pretrained(gpu_models["qwen2"], rmpad=True,
                                                   dtype=torch.bfloat16)
    prompts = _prompts(12, seed=1)
    params = SamplingParams(temperature=0.8, top_p=0.9, ignore_eos=True, max_new_tokens=16,
                            seed=3)
    graphed = ContinuousEngine(model, 512, max_rows=8)
    assert graphed.cache.flash_decode and graphed._steps[1].use_graph
    with_graphs = _staggered(graphed, prompts, params)
    assert any(s.graph is not None for s in graphed._steps.values())
    monkeypatch.setenv("PARALLEL_MODELS_CUDA_GRAPHS", "0")
    eager = _staggered(ContinuousEngine(model, 512, max_rows=8), prompts, params)
    assert [s.token_ids for s in with_graphs] == [s.token_ids for s in eager]
    # log-probs of the drawn tokens vs a fresh forward of prompt + response (bf16 tolerance)
    for p, s in zip(prompts[:4], with_graphs[:4]):
        ids = torch.tensor(p + s.token_ids, device=DEV)
        cu = torch.tensor([0, len(ids)], dtype=torch.int32, device=DEV)
        with torch.no_grad():
            logits = model(ids, cu, full_vocab=True).logits.float() / 0.8
        fresh = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(
            -1, ids[len(p):, None]).squeeze(-1)
        got = torch.tensor(s.log_probs, device=DEV)
        assert (fresh - got).abs().max().item() <= 5e-2


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_decode_is_captured_and_equals_eager(tmp_path, single_rank, monkeypatch, family):
    """An MoE model's decode buckets are captured in CUDA graphs (the dispatch stays on the
    device, ``layers/moe_local_dispatch``; before, capture failed and it decoded eagerly) and
    give the eager engine's tokens and log-probs, bf16, grouped GEMMs."""
    import warnings

    import parallel_models as pm
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.testing import save_tiny_hf_model

    path = save_tiny_hf_model(str(tmp_path / family), family, seed=0, hidden_size=256,
                              intermediate_size=512, moe_intermediate_size=128,
                              num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                              vocab_size=1001, num_experts=16, num_experts_per_tok=4)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.bfloat16)
    prompts = _prompts(10, seed=2)
    params = SamplingParams(temperature=0.8, ignore_eos=True, max_new_tokens=12, seed=5)
    graphed = ContinuousEngine(model, 512, max_rows=8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="CUDA graph capture")
        with_graphs = _staggered(graphed, prompts, params)
    assert any(s.graph is not None for s in graphed._steps.values())
    monkeypatch.setenv("PARALLEL_MODELS_CUDA_GRAPHS", "0")
    eager = _staggered(ContinuousEngine(model, 512, max_rows=8), prompts, params)
    assert [s.token_ids for s in with_graphs] == [s.token_ids for s in eager]
    # eager decode runs other kernels: bf16 tolerance (a near-tied router may pick another
    # expert for a token, so the largest difference is looser than the typical one)
    diff = torch.cat([(torch.tensor(a.log_probs) - torch.tensor(b.log_probs)).abs()
                      for a, b in zip(with_graphs, eager)])
    assert diff.mean() <= 5e-3 and diff.max() <= 0.1, (diff.mean(), diff.max())
