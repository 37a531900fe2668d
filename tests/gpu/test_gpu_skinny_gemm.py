"""The skinny decode GEMM on the GPU (bf16): within one bf16 unit of torch's fp32 product at the
0.89B model's five decode products and the decode buckets' row counts, with its default and
other launch configs, the same bits every run (the K splits are summed in a fixed order);
replayed from a CUDA graph it follows new inputs and leaves its split-K counters zeroed; a graph
captured before a shape ran eagerly still computes it (no split);
the model's logits with ``PARALLEL_MODELS_DECODE_GEMM=triton`` match cuBLAS's, and the engine
decodes through it with graphs exactly as eagerly.

(Greedy tokens are not compared with cuBLAS's here: bf16 logits of a random model tie often
enough that one unit in the last place flips an argmax over a 40-token run; the CPU test
compares the tokens of a short run, and the logits are compared here.)"""

from __future__ import annotations

import pytest
import torch

DEV = "cuda"
pytest.importorskip("triton")

SHAPES = [(4096, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048)]


def _excess(got, want) -> float:
    """Largest ``|got - want|`` beyond one bf16 unit in the last place of ``want``."""
    want = want.float()
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(
        want.abs().clamp_min(2.0 ** -20))))
    return ((got.float() - want).abs() - ulp).max().item()


def _operands(rows, n, k, seed=0, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, k, device=DEV, generator=g).bfloat16()
    w = (torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).bfloat16()
    b = torch.randn(n, device=DEV, generator=g).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", [1, 16, 64, 256, 100])
@pytest.mark.parametrize("n,k", SHAPES)
def test_decode_shapes_match_fp32_matmul(rows, n, k):
    from parallel_models.rl.rollout.skinny_gemm import reference_linear, skinny_linear

    x, w, _ = _operands(rows, n, k, seed=rows)
    got = skinny_linear(x, w)
    assert _excess(got, reference_linear(x, w)) <= 1e-3
    for _ in range(3):  # counters left zeroed; splits summed in split order: the same bits
        assert torch.equal(skinny_linear(x, w), got)


@pytest.mark.parametrize("config", ["32,64,128,4,4,4", "128,64,64,2,8,3", "64,16,256,16,4,5",
                                    "64,128,64,1,8,3", "64,256,64,2,8,2", "16,32,128,8,4,6"])
def test_launch_configs_match_fp32_matmul(monkeypatch, config):
    """The settings the sweep (bench/decode_gemm_sweep.py) may pick compute the same product
    (PARALLEL_MODELS_DECODE_GEMM_CONFIG), with a bias, N off the tiles."""
    from parallel_models.rl.rollout.skinny_gemm import reference_linear, skinny_linear

    monkeypatch.setenv("PARALLEL_MODELS_DECODE_GEMM_CONFIG", config)
    for rows, n, k in ((64, 2048, 2048), (200, 1000, 5632), (3, 32000, 2048)):
        x, w, b = _operands(rows, n, k, seed=n, bias=True)
        assert _excess(skinny_linear(x, w, b), reference_linear(x, w, b)) <= 1e-3


def test_cuda_graph_replay_follows_new_inputs():
    from parallel_models.rl.rollout import skinny_gemm
    from parallel_models.rl.rollout.skinny_gemm import reference_linear, skinny_linear
    from parallel_models.rl.rollout.skinny_gemm_config import LaunchConfig

    split = LaunchConfig(64, 64, 128, 4, 4, 4)
    x, w, b = _operands(64, 2048, 2048, seed=1, bias=True)
    skinny_linear(x, w, b, config=split)  # compile and allocate the workspace outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, b, config=split)
        out2 = skinny_linear(out, w, config=split)  # two in a row share the workspace
    for seed in (2, 3):
        x.copy_(_operands(64, 2048, 2048, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        want = reference_linear(x, w, b)
        assert _excess(out, want) <= 1e-3
        assert _excess(out2, reference_linear(out, w)) <= 1e-3
    for _, locks in skinny_gemm._WORKSPACES.values():
        assert not locks.any()


def test_capture_before_any_eager_call_uses_no_split():
    """A shape whose workspace does not exist yet when a graph is captured: no allocation
    inside the capture, one split instead, same product."""
    from parallel_models.rl.rollout import skinny_gemm
    from parallel_models.rl.rollout.skinny_gemm import reference_linear, skinny_linear
    from parallel_models.rl.rollout.skinny_gemm_config import LaunchConfig

    split = LaunchConfig(64, 32, 128, 4, 4, 3)
    x, w, _ = _operands(24, 1536, 1024, seed=4)  # N = 1536: no other test uses it
    # compile both kernels outside the capture (the split one on another N)
    skinny_linear(x, w, config=LaunchConfig(64, 32, 128, 1, 4, 3))
    skinny_linear(x, w[:1024], config=split)
    before = len(skinny_gemm._WORKSPACES)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, config=split)
    graph.replay()
    torch.cuda.synchronize()
    assert len(skinny_gemm._WORKSPACES) == before
    assert _excess(out, reference_linear(x, w)) <= 1e-3


def test_model_logits_and_engine_through_the_kernel(gpu_models, single_rank, monkeypatch):
    import parallel_models as pm

    from parallel_models.rl.rollout import skinny_gemm
    from parallel_models.rl.rollout.continuous import ContinuousEngine
    from parallel_models.rl.rollout.sampling import SamplingParams

    model = pm.AutoModelForCausalLM.from_pretrained(gpu_models["qwen2"], rmpad=True,
                                                   dtype=torch.bfloat16)  # qkv bias, tied head
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 1000, (200,), generator=g).to(DEV)
    cu = torch.tensor([0, 50, 200], dtype=torch.int32, device=DEV)
    calls = {"n": 0}
    plain = skinny_gemm.skinny_linear

    def counting(*args, **kwargs):
        calls["n"] += 1
        return plain(*args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_linear", counting)
    logits = {}
    with torch.no_grad():
        for gemm in ("cublas", "triton"):
            monkeypatch.setenv("PARALLEL_MODELS_DECODE_GEMM", gemm)
            logits[gemm] = model.forward_packed(ids, cu, full_vocab=True).logits.float()
    assert calls["n"] >= 3 * 4 + 1  # every linear of the 3 layers and the head
    ref = logits["cublas"]
    assert ((logits["triton"] - ref).norm() / ref.norm()).item() < 2e-2

    prompts = [torch.randint(3, 1000, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 200, (10,), generator=g)]
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=40)

    def run(engine):
        reqs = []
        for p in prompts:
            reqs.append(engine.submit(p, params))
            engine.step()
        engine.run()
        return [r.samples[0].token_ids for r in reqs]

    calls["n"] = 0
    graphed = ContinuousEngine(model, 4096, max_rows=8, max_row_tokens=300)
    with_graphs = run(graphed)
    assert any(s.graph is not None for s in graphed._steps.values()) and calls["n"] > 0
    monkeypatch.setenv("PARALLEL_MODELS_CUDA_GRAPHS", "0")
    eager = ContinuousEngine(model, 4096, max_rows=8, max_row_tokens=300)
    assert run(eager) == with_graphs
