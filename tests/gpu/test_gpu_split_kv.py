"""The split-KV Triton decode attention on the GPU (bf16): against SDPA at the 0.89B model's head
shapes (16 heads / 8 KV heads, head_dim 128) for lengths 1 .. 2100 over many splits; the new
token's k/v land in the pool and nothing else changes; replayed from a CUDA graph captured once
(grid fixed by max_row_tokens) it follows new lengths and offsets; the engine decodes through it
with graphs exactly as eagerly."""

from __future__ import annotations

import pytest
import torch

DEV = "cuda"
pytest.importorskip("triton")


def _case(lengths, max_row, heads=16, kv=8, d=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    rows = len(lengths)
    pool = rows * max_row + 5

    def rand(*shape):
        return torch.randn(*shape, device=DEV, dtype=dtype, generator=g)

    offsets = torch.arange(rows, device=DEV) * max_row + 2
    return dict(q=rand(rows, heads, d), k_new=rand(rows, kv, d), v_new=rand(rows, kv, d),
                k_pool=rand(pool, kv, d), v_pool=rand(pool, kv, d), offsets=offsets,
                used=torch.tensor(lengths, device=DEV, dtype=torch.int32))


def _run(c, max_row, fn):
    return fn(c["q"], c["k_new"], c["v_new"], c["k_pool"], c["v_pool"], c["offsets"], c["used"],
              max_row, 128 ** -0.5)


@pytest.mark.parametrize("lengths,max_row", [
    ([1, 2, 127, 128, 129, 300, 384, 77] * 8, 384),    # the bench's bucket (3 splits of 128)
    ([1, 2100, 1000, 129, 2048, 5, 640, 2176], 2176),  # the GRPO cap (17 splits)
    ([1, 64, 100, 128], 128),                          # one split: no combine pass
])
def test_matches_sdpa_bf16(lengths, max_row):
    from parallel_models.inference.split_kv_attention import reference_decode, split_kv_decode

    c = _case(lengths, max_row)
    ref_pools = {k: c[k].clone() for k in ("k_pool", "v_pool")}
    ref = reference_decode(c["q"], c["k_new"], c["v_new"], ref_pools["k_pool"],
                           ref_pools["v_pool"], c["offsets"], c["used"], 128 ** -0.5)
    got = _run(c, max_row, split_kv_decode)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(c["k_pool"], ref_pools["k_pool"])  # the new token written, nothing else
    assert torch.equal(c["v_pool"], ref_pools["v_pool"])


@pytest.mark.parametrize("config", ["16,2,1", "128,8,3", "32,4,4,64", "64,4,2,512"])
def test_launch_configs_match_sdpa_bf16(monkeypatch, config):
    """The launch settings the sweep (bench/decode_attention_sweep.py) may pick compute the
    same attention (PARALLEL_MODELS_DECODE_KERNEL_CONFIG)."""
    from parallel_models.inference.split_kv_attention import reference_decode, split_kv_decode

    monkeypatch.setenv("PARALLEL_MODELS_DECODE_KERNEL_CONFIG", config)
    lengths, max_row = [1, 2, 127, 128, 129, 300, 384, 77], 384
    c = _case(lengths, max_row, seed=3)
    ref = reference_decode(c["q"], c["k_new"], c["v_new"], c["k_pool"].clone(),
                           c["v_pool"].clone(), c["offsets"], c["used"], 128 ** -0.5)
    got = _run(c, max_row, split_kv_decode)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_rope_in_the_kernel_matches_rotary_then_attention_bf16():
    """PARALLEL_MODELS_DECODE_FUSE_ROPE: q / new k rotated in the kernel (bf16, 0.89B heads)."""
    from parallel_models.llama.layers.rotary import apply_rotary
    from parallel_models.inference.split_kv_attention import reference_decode, split_kv_decode

    lengths, max_row = [1, 2, 127, 128, 129, 300, 384, 77], 384
    c = _case(lengths, max_row, seed=4)
    angles = c["used"].float()[:, None] * torch.rand(64, device=DEV)
    cos = torch.cat([angles, angles], -1).cos().bfloat16()
    sin = torch.cat([angles, angles], -1).sin().bfloat16()
    pools = {k: c[k].clone() for k in ("k_pool", "v_pool")}
    ref = reference_decode(apply_rotary(c["q"], cos, sin), apply_rotary(c["k_new"], cos, sin),
                           c["v_new"], pools["k_pool"], pools["v_pool"], c["offsets"], c["used"],
                           128 ** -0.5)
    got = split_kv_decode(c["q"], c["k_new"], c["v_new"], c["k_pool"], c["v_pool"], c["offsets"],
                          c["used"], max_row, 128 ** -0.5, rope=(cos, sin))
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # the stored k: rotated in fp32, rounded once (eager bf16 rounds each op): 1 bf16 ulp
    torch.testing.assert_close(c["k_pool"].float(), pools["k_pool"].float(), atol=2e-2, rtol=1e-2)


def test_cuda_graph_replay_follows_new_lengths():
    from parallel_models.inference.split_kv_attention import reference_decode, split_kv_decode

    max_row = 640
    c = _case([1, 5, 300, 640], max_row)
    _run(c, max_row, split_kv_decode)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(c, max_row, split_kv_decode)
    for lengths in ([2, 6, 301, 129], [640, 1, 1, 200]):
        c["used"].copy_(torch.tensor(lengths, device=DEV, dtype=torch.int32))
        c["offsets"].copy_(c["offsets"].flip(0))  # rows moved to other regions
        pools = {k: c[k].clone() for k in ("k_pool", "v_pool")}
        ref = reference_decode(c["q"], c["k_new"], c["v_new"], pools["k_pool"], pools["v_pool"],
                               c["offsets"], c["used"], 128 ** -0.5)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(c["k_pool"], pools["k_pool"])


def test_engine_uses_the_kernel_with_graphs_as_eagerly(gpu_models, single_rank, monkeypatch):
    import parallel_models as pm

    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    model = pm.AutoModelForCausalLM.from_pretrained(gpu_models["llama"], rmpad=True,
                                                   dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
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

    graphed = ContinuousEngine(model, 4096, max_rows=8, max_row_tokens=300)
    assert graphed.cache.decode_kernel == "triton"
    with_graphs = run(graphed)
    assert any(s.graph is not None for s in graphed._steps.values())
    monkeypatch.setenv("PARALLEL_MODELS_CUDA_GRAPHS", "0")
    eager = ContinuousEngine(model, 4096, max_rows=8, max_row_tokens=300)
    assert run(eager) == with_graphs
