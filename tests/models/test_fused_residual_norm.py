"""Generation with each layer's residual sum fused into the next layer's norm
(``ParallelDecoder._forward_fused``, on whenever a KV cache is used) computes exactly what the
plain layer loop computes: fp32 on the CPU, the continuous engine's tokens and log-probs bitwise
equal with ``PARALLEL_MODELS_DECODE_FUSE_NORM`` on and off (Llama with GQA, Qwen2 with qkv bias
and tied embeddings)."""

import pytest

from parallel_models.testing import run_distributed


def _tokens(path: str) -> dict:
    import os

    import torch

    import parallel_models as pm
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (4, 11)]
    params = SamplingParams(temperature=0.9, ignore_eos=True, max_new_tokens=6, seed=1)
    out, calls = {}, []
    fused = model.model._forward_fused
    model.model._forward_fused = lambda *a: (calls.append(1), fused(*a))[1]
    for fuse in ("1", "0"):
        os.environ["PARALLEL_MODELS_DECODE_FUSE_NORM"] = fuse
        eng = ContinuousEngine(model, 64, max_rows=2)
        reqs = [eng.submit(p, params) for p in prompts]
        eng.run()
        out[fuse] = [(r.samples[0].token_ids, r.samples[0].log_probs) for r in reqs]
        out[f"calls_{fuse}"] = len(calls)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_residual_norm_is_exact(hf_models, family):
    out = run_distributed(_tokens, 1, hf_models[(family, "causal_lm")], timeout=300)[0]
    assert out["calls_1"] > 0 and out["calls_0"] == out["calls_1"]  # fused only when on
    assert out["1"] == out["0"]
