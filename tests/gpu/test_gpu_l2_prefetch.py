"""The decode step's L2 weight prefetch on Hopper (``rl/rollout/l2_prefetch``): the bulk
prefetch kernel compiles and runs (captured in a CUDA graph too) without touching the data; the
continuous engine with prefetch on gives exactly the tokens and log-probs of the engine with it
off, bf16, CUDA graphs per bucket."""

from __future__ import annotations

import pytest
import torch

DEV = "cuda"


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not _hopper(), reason="the bulk L2 prefetch needs sm_90")
def test_prefetch_kernel_runs_and_leaves_data():
    from parallel_models.rl.rollout import l2_prefetch

    w = torch.randn(3001, 517, device=DEV, dtype=torch.bfloat16)  # odd sizes: a tail chunk
    before = w.clone()
    l2_prefetch.prefetch(w, 1 << 30)
    l2_prefetch.prefetch(w, 4096)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        l2_prefetch.prefetch(w, 1 << 20)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before)


@pytest.mark.skipif(not _hopper(), reason="the bulk L2 prefetch needs sm_90")
def test_engine_with_prefetch_equals_without(gpu_models, single_rank, monkeypatch):
    import parallel_models as pm

    from parallel_models.rl.rollout.continuous import ContinuousEngine
    from parallel_models.rl.rollout.sampling import SamplingParams

    model = pm.AutoModelForCausalLM.from_pretrained(gpu_models["llama"], rmpad=True,
                                                   dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1000, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 40, (10,), generator=g)]
    params = SamplingParams(temperature=0.8, ignore_eos=True, max_new_tokens=14, seed=2)
    out = {}
    for on in ("1", "0"):
        monkeypatch.setenv("PARALLEL_MODELS_DECODE_L2_PREFETCH", on)
        eng = ContinuousEngine(model, 512, max_rows=8)
        assert (eng.prefetcher is not None) == (on == "1")
        reqs = [eng.submit(p, params) for p in prompts]
        eng.run()
        assert any(s.graph is not None for s in eng._steps.values())
        out[on] = [(r.samples[0].token_ids, r.samples[0].log_probs) for r in reqs]
    assert out["1"] == out["0"]
