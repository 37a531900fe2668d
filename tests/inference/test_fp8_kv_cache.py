"""The FP8 KV cache of the continuous engine (``PoolKVCache(kv_cache_dtype="fp8")``,
``rollout.kv_cache_dtype``): the pool's quantize -> dequantize round trip is within e4m3's bound
per (token, KV head) with scale = amax / 448; the planner's KV bytes per token halve (+ the
scales) and it plans about twice the tokens; the engine on a tiny Llama (one gloo rank, fp32,
PyTorch's SDPA paths: decode, the n samples' shared prefill, a resumed request's extension
prefill) generates greedy tokens mostly equal to the model-dtype pool's with log-probs within a
bound, yet not bit-identical (the option is not ignored); the config refuses
``rollout.exact=true`` with it and passes it to the engine. The split-KV kernel on an fp8 pool:
tests/inference/test_split_kv_fp8.py."""

import pytest
import torch

from parallel_models.inference import memory_plan as mp
from parallel_models.inference.kv_quant import dequantize_kv, quantize_kv
from parallel_models.inference.pool_cache import PoolKVCache
from parallel_models.testing import run_distributed

E4M3_REL = 2.0 ** -4  # e4m3 (3 mantissa bits, round to nearest): normal values' relative error
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # in units of the scale: subnormals' spacing


def test_pool_round_trip_within_the_e4m3_bound_per_token_and_head():
    g = torch.Generator().manual_seed(0)
    layers, positions, kv, d = 2, 12, 3, 16
    cache = PoolKVCache(layers, positions, 2, positions, kv, d, torch.float32, "cpu",
                        kv_cache_dtype="fp8")
    assert cache.k.dtype == torch.float8_e4m3fn and cache.k_scale.shape == (layers, 14, kv)
    # magnitudes over 8 decades per head, one all-zero (token, head)
    k = torch.randn(positions, kv, d, generator=g) * torch.logspace(-4, 4, positions)[:, None, None]
    v = torch.randn(positions, kv, d, generator=g)
    k[3, 1] = 0
    index = torch.randperm(positions, generator=g)
    cache.store(1, index, k, v)
    got_k, got_v = cache.gather(1, index)
    for want, got, scale in ((k, got_k, cache.k_scale[1][index]),
                             (v, got_v, cache.v_scale[1][index])):
        amax = want.abs().amax(-1)
        assert torch.equal(scale, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
        bound = torch.maximum(E4M3_REL * want.abs(), 0.5 * E4M3_SUBNORMAL_STEP * scale[..., None])
        assert ((got - want).abs() <= bound * (1 + 1e-6)).all()
        assert not torch.equal(got, want)  # it was quantized
    data, scale = quantize_kv(v)
    assert torch.equal(dequantize_kv(data, scale, torch.float32), got_v)
    assert torch.equal(got_k[3, 1], torch.zeros(d)) and cache.k_scale[1][index][3, 1] == 1
    assert (cache.k_scale[0] == 1).all() and (cache.k[0].float() == 0).all()  # other layer
    # a region's read / write / copy carry the scales along
    saved = cache.read(0, 5)
    cache.copy(0, [6], 5)
    assert torch.equal(cache.gather(1, torch.arange(6, 11))[0], cache.gather(1, torch.arange(5))[0])
    cache.store(1, torch.arange(5), v[:5], k[:5])
    cache.write(0, *saved)
    assert torch.equal(cache.gather(1, torch.arange(5))[1], cache.gather(1, torch.arange(6, 11))[1])


def test_model_dtype_pool_is_unchanged_and_bad_dtypes_refused():
    cache = PoolKVCache(1, 8, 2, 8, 2, 16, torch.float32, "cpu")
    assert cache.k.dtype == torch.float32 and cache.k_scale is None
    x = torch.randn(3, 2, 16)
    cache.store(0, torch.tensor([1, 4, 5]), x, -x)
    assert torch.equal(cache.gather(0, torch.tensor([1, 4, 5]))[0], x)  # bit for bit
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PoolKVCache(1, 8, 2, 8, 2, 16, torch.float32, "cpu", kv_cache_dtype="int8")


def test_planner_counts_one_byte_per_element_plus_the_scales():
    bf16 = mp.ModelShape(layers=32, hidden=4096, intermediate=7168, heads=16, kv_heads=4,
                         head_dim=128, vocab=128256, dtype_bytes=2)
    fp8 = mp.ModelShape(**{**bf16.__dict__, "kv_fp8": True})
    assert mp.kv_bytes_per_token(bf16) == 2 * 32 * 4 * 128 * 2
    assert mp.kv_bytes_per_token(fp8) == 2 * 32 * 4 * (128 + 4)  # e4m3 + an fp32 scale per head
    args = dict(total=80 << 30, in_use=40 << 30, weights=8 << 30, utilization=0.9,
                longest_prompt=512, longest_row=1536, rows=4096, max_prefill_tokens=16384)
    a, b = mp.plan_memory(bf16, **args), mp.plan_memory(fp8, **args)
    assert a.prefill_tokens == b.prefill_tokens
    # the same KV bytes (to a token), 256 / 132 times the tokens
    assert abs(a.kv_tokens * a.kv_per_token - b.kv_tokens * b.kv_per_token) <= b.kv_per_token
    assert b.kv_tokens / a.kv_tokens == pytest.approx(256 / 132, rel=1e-3)


def test_config_refuses_exact_and_passes_the_dtype_down():
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config.ppo import load_config

    assert load_config(None, []).rollout.engine_options()["kv_cache_dtype"] == "bf16"
    cfg = load_config(None, ["rollout.kv_cache_dtype=fp8"])
    assert cfg.rollout.engine_options()["kv_cache_dtype"] == "fp8"
    assert cfg.actor.rollout_correction.level is None  # (rollout.dtype sets the correction)
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype=fp8 with rollout.exact"):
        load_config(None, ["rollout.kv_cache_dtype=fp8", "rollout.exact=true"])
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype"):
        load_config(None, ["rollout.kv_cache_dtype=fp16"])


def _generate(path: str) -> dict:
    import parallel_models as pm
    from parallel_models.inference import RolloutEngine
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (4, 11, 17, 7)]
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=12, n=2)
    out = {}
    for dtype in ("bf16", "fp8"):  # bf16: the model's dtype (fp32 here)
        engine = RolloutEngine(model, kv_budget_tokens=400, max_rows=8, kv_cache_dtype=dtype)
        gen = engine.generate(prompts, params)
        eng = engine.continuous_engine()
        assert eng.cache.fp8 == (dtype == "fp8") and eng.cache.decode_kernel == "aten"
        mask = gen.response_mask.bool()
        rows = [(gen.responses[i][mask[i]].tolist(), gen.log_probs[i][mask[i]].tolist())
                for i in range(len(mask))]
        # a resumed request: its new tokens through the extension prefill (kv_extend)
        resumable = ContinuousEngine(model, 200, max_rows=4, max_row_tokens=60,
                                     decode_extension_tokens=0, kv_cache_dtype=dtype)
        one = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=8)
        first = resumable.submit(prompts[1], one, keep_kv=True)
        resumable.run()
        again = resumable.submit(prompts[1] + first.samples[0].token_ids + [5, 6, 7], one,
                                 resume=first.kept)
        resumable.run()
        assert resumable.prefill_calls == 2
        rows.append((again.samples[0].token_ids, again.samples[0].log_probs))
        out[dtype] = rows
    return out


@pytest.fixture(scope="module")
def generated(hf_models):
    return run_distributed(_generate, 1, hf_models[("llama", "causal_lm")], timeout=300)[0]


def test_engine_with_an_fp8_pool_stays_close_to_the_model_dtype_pool(generated):
    same = total = 0
    diffs = []
    for (tok_a, lp_a), (tok_b, lp_b) in zip(generated["bf16"], generated["fp8"]):
        assert len(tok_a) == len(tok_b) > 0
        for i, (a, b) in enumerate(zip(tok_a, tok_b)):
            total += 1
            if a != b:
                break  # after a different token the contexts differ
            same += 1
            diffs.append(abs(lp_a[i] - lp_b[i]))
    # K / V within 2^-4 relatively (scores' errors average out over head_dim and the softmax):
    # measured 82 / 84 tokens equal, |logprob diff| 0.004 at most, 0.0009 on average
    assert same / total >= 0.9, (same, total)
    assert max(diffs) < 0.03 and sum(diffs) / len(diffs) < 0.005, max(diffs)
    assert max(diffs) > 0  # not bit-identical: the pool was quantized


def test_server_flag():
    from parallel_models.inference.server.cli import build_parser

    assert build_parser().parse_args(["--model", "m"]).kv_cache_dtype == "bf16"
    assert build_parser().parse_args(["--model", "m", "--kv-cache-dtype", "fp8"]) \
        .kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--kv-cache-dtype", "int8"])
