"""The split-KV Triton decode attention on an fp8 KV pool (``kv_scales``: e4m3 pools with fp32
scales per (position, KV head), ``pool_cache``) in Triton's CPU interpreter, fp32: the attention
equals SDPA over the dequantized pool (the step's own token unquantized, as the kernel attends
it) for one and several splits, GQA groups, in-kernel RoPE; the new token lands in the pool
quantized exactly as ``pool_cache.quantize_kv`` would (bytes and scales); the kernel's self-check
passes on an fp8 pool; and the continuous engine decoding through the kernel on an fp8 pool stays
close to its SDPA path on the same pool. Skipped without triton (not a dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.kv_quant import quantize_kv  # noqa: E402
from parallel_models.inference.split_kv_attention import (reference_decode,  # noqa: E402
                                                           split_kv_decode, supported)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads,kv_heads,split,max_row,used,rope", [
    (4, 2, 16, 80, [1, 16, 17, 33, 80], False),  # several splits; length 1, = / past a split
    (4, 1, 32, 32, [1, 5, 32], False),           # one split (no combine pass), group 4
    (2, 2, 16, 50, [50, 2, 31], True),           # no GQA; q / k rotated in the kernel
])
def test_fp8_pool_matches_sdpa_on_the_dequantized_pool(heads, kv_heads, split, max_row, used,
                                                       rope):
    from parallel_models.llama.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(len(used))
    d, rows = 16, len(used)
    pool = max_row * rows + 7
    # keys over a wide range of magnitudes per (position, head): the scales matter
    k_pool = torch.randn(pool, kv_heads, d, generator=g) * torch.rand(pool, kv_heads, 1,
                                                                      generator=g) * 8
    v_pool = torch.randn(pool, kv_heads, d, generator=g)
    (k_q, k_s), (v_q, v_s) = quantize_kv(k_pool), quantize_kv(v_pool)
    q = torch.randn(rows, heads, d, generator=g)
    k_new = torch.randn(rows, kv_heads, d, generator=g) * 3
    v_new = torch.randn(rows, kv_heads, d, generator=g)
    angles = torch.tensor(used)[:, None] * torch.rand(d // 2, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q_ref, k_ref_new = (apply_rotary(q, cos, sin), apply_rotary(k_new, cos, sin)) if rope \
        else (q, k_new)
    offsets = torch.tensor([3 + i * max_row for i in range(rows)])
    used_t = torch.tensor(used, dtype=torch.int32)
    refs = k_q.clone(), v_q.clone(), k_s.clone(), v_s.clone()
    ref = reference_decode(q_ref, k_ref_new, v_new, refs[0], refs[1], offsets, used_t, 0.3,
                           kv_scales=(refs[2], refs[3]))
    got = split_kv_decode(q.to(DEV), k_new.to(DEV), v_new.to(DEV), k_q.to(DEV), v_q.to(DEV),
                          offsets.to(DEV), used_t.to(DEV), max_row, 0.3, split=split,
                          rope=(cos.to(DEV), sin.to(DEV)) if rope else None,
                          kv_scales=(k_s.to(DEV), v_s.to(DEV)))
    assert (got.cpu() - ref).abs().max().item() < 1e-5
    # the same attention on the unquantized pool differs (the kernel read the e4m3 pool)
    plain = reference_decode(q_ref, k_ref_new, v_new, k_pool.clone(), v_pool.clone(), offsets,
                             used_t, 0.3)
    assert (plain - ref).abs().max().item() > 1e-4
    if DEV == "cpu":  # the new tokens quantized into the pool as quantize_kv does
        if rope:  # (the kernel's rotation rounds differently from apply_rotary's in the last
            # bit: the scales agree to fp32 rounding, the bytes but for a rare e4m3 step)
            assert torch.allclose(k_s, refs[2], rtol=1e-6, atol=0)
            assert (k_q.view(torch.uint8) != refs[0].view(torch.uint8)).sum() <= 2
        else:
            assert torch.equal(k_q.view(torch.uint8), refs[0].view(torch.uint8))
            assert torch.equal(k_s, refs[2])
        assert torch.equal(v_q.view(torch.uint8), refs[1].view(torch.uint8))
        assert torch.equal(v_s, refs[3])


def test_new_bf16_tokens_on_e4m3_ties_land_as_quantize_kv_stores_them():
    """bf16 keys / values over a bf16 amax land exactly on e4m3 ties in ~5 of 10^4 elements; the
    kernel's store rounds them as ``quantize_kv`` (x times the reciprocal of the scale) does."""
    g = torch.Generator().manual_seed(1)
    rows, kv_heads, d, max_row = 16, 4, 128, 4
    k_new, v_new = ((torch.randn(rows, kv_heads, d, generator=g) * 3).bfloat16().float()
                    for _ in range(2))
    scale = k_new.abs().amax(-1, keepdim=True) / 448
    assert ((k_new / scale).to(torch.float8_e4m3fn).float()
            != (k_new * (1 / scale)).to(torch.float8_e4m3fn).float()).any()  # ties present
    pool = max_row * rows
    (k_q, k_s), (v_q, v_s) = (quantize_kv(torch.zeros(pool, kv_heads, d)) for _ in range(2))
    offsets = torch.arange(rows) * max_row
    used = torch.ones(rows, dtype=torch.int32)  # the new token at each row's first position
    q = torch.randn(rows, kv_heads, d, generator=g)
    k_q, v_q, k_s, v_s = (t.to(DEV) for t in (k_q, v_q, k_s, v_s))
    split_kv_decode(q.to(DEV), k_new.to(DEV), v_new.to(DEV), k_q, v_q, offsets.to(DEV),
                    used.to(DEV), max_row, 0.1, split=16, kv_scales=(k_s, v_s))
    for got_q, got_s, new in ((k_q, k_s, k_new), (v_q, v_s, v_new)):
        want_q, want_s = quantize_kv(new)
        assert torch.equal(got_q.cpu()[offsets].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(got_s.cpu()[offsets], want_s)


def test_self_check_passes_on_an_fp8_pool_and_bad_scales_are_refused():
    assert supported(torch.device(DEV), torch.float32, 2, 16, fp8_kv=True)
    q, kv = torch.zeros(1, 2, 16), torch.zeros(1, 2, 16)
    pool = torch.zeros(8, 2, 16).to(torch.float8_e4m3fn)
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="kv_scales"):
        split_kv_decode(q, kv, kv, pool, pool, one, one.int() + 1, 8, 1.0,
                        kv_scales=(torch.ones(8, 3), torch.ones(8, 3)))


def _engine_tokens(path: str) -> dict:
    from tests.helpers.split_kv_engine import staggered_run, tiny_model_and_prompts

    model, prompts, params = tiny_model_and_prompts(path)
    # "aten" on the CPU: masked SDPA over the fp8 pool
    return {kernel: staggered_run(model, prompts, params, kernel, kv_cache_dtype="fp8")[0]
            for kernel in ("aten", "triton")}


def test_engine_through_the_kernel_on_an_fp8_pool_stays_close_to_sdpa(hf_models):
    from parallel_models.testing import run_distributed

    out = run_distributed(_engine_tokens, 1, hf_models[("llama", "causal_lm")], timeout=300)[0]
    for (tok_a, lp_a), (tok_t, lp_t) in zip(out["aten"], out["triton"]):
        # the kernel attends the step's own token unquantized, SDPA reads it back from the
        # pool: the difference is one key / value's e4m3 rounding
        assert tok_t == tok_a
        assert max(abs(a - b) for a, b in zip(lp_a, lp_t)) < 0.02
