"""The split-KV Triton decode attention (inference/split_kv_attention.py) in Triton's CPU
interpreter, fp32, against SDPA row by row: lengths 1, split multiples and non-multiples, one and
several splits, GQA groups 1/2/4; the new token's k/v land in the pool and nothing else changes.
Then the continuous engine decoding through the kernel gives exactly the tokens of its SDPA path
and of transformers.generate (greedy, fp32). Skipped without triton (not a dependency)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.inference.split_kv_attention import (reference_decode,  # noqa: E402
                                                           split_kv_decode)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads,kv_heads,split,max_row,used", [
    (4, 2, 16, 80, [1, 16, 17, 33, 80]),      # several splits; length 1, = / past a split
    (4, 1, 32, 32, [1, 5, 32]),               # one split (no combine pass), group 4
    (2, 2, 16, 50, [50, 2, 31]),              # no GQA; the longest row first
])
def test_matches_sdpa_and_writes_the_new_token(heads, kv_heads, split, max_row, used):
    g = torch.Generator().manual_seed(len(used))
    d, rows = 16, len(used)
    pool = max_row * rows + 7
    k_pool = torch.randn(pool, kv_heads, d, generator=g)
    v_pool = torch.randn(pool, kv_heads, d, generator=g)
    q = torch.randn(rows, heads, d, generator=g)
    k_new = torch.randn(rows, kv_heads, d, generator=g)
    v_new = torch.randn(rows, kv_heads, d, generator=g)
    offsets = torch.tensor([3 + i * max_row for i in range(rows)])  # gaps between regions
    used_t = torch.tensor(used, dtype=torch.int32)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    ref = reference_decode(q, k_new, v_new, k_ref, v_ref, offsets, used_t, 0.3)
    got = split_kv_decode(q.to(DEV), k_new.to(DEV), v_new.to(DEV), k_pool.to(DEV),
                          v_pool.to(DEV), offsets.to(DEV), used_t.to(DEV), max_row, 0.3,
                          split=split)
    assert (got.cpu() - ref).abs().max().item() < 1e-5
    if DEV == "cpu":  # on CUDA the pools were copied by .to(); the GPU test checks the write
        assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


def test_bad_shapes_are_refused():
    q = torch.zeros(1, 3, 16)
    kv = torch.zeros(1, 2, 16)
    pool = torch.zeros(8, 2, 16)
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        split_kv_decode(q, kv, kv, pool, pool, one, one.int() + 1, 8, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        split_kv_decode(torch.zeros(1, 2, 16), kv, kv, pool, pool, one, one.int() + 1, 8, 1.0,
                        split=24)


def _engine_tokens(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    from parallel_models.inference.continuous import ContinuousEngine
    from tests.helpers.split_kv_engine import staggered_run, tiny_model_and_prompts

    model, prompts, params = tiny_model_and_prompts(path)
    out = {}
    for kernel in ("aten", "triton", "triton_rope_apart"):
        os.environ["PARALLEL_MODELS_DECODE_FUSE_ROPE"] = "0" if kernel.endswith("apart") else "1"
        # "aten" on the CPU = masked SDPA over the pool; "triton" rotates q / k in the kernel
        out[kernel] = staggered_run(model, prompts, params, kernel.split("_")[0])[0]
        # a re-entry fed through the decode step (5 entries of one row, decode_layout) while
        # another row decodes; then the same context prefilled whole by a fresh engine
        eng = ContinuousEngine(model, 120, max_rows=8, max_row_tokens=40)
        eng.cache.decode_kernel = kernel.split("_")[0]
        first = eng.submit(prompts[1], params, keep_kv=True)
        eng.run()
        context = prompts[1] + first.samples[0].token_ids + [5, 6, 7, 8]
        other = eng.submit(prompts[2], params)
        eng.step()
        again = eng.submit(context, params, resume=first.kept)
        eng.run()
        fresh = ContinuousEngine(model, 120, max_rows=4, max_row_tokens=40)
        fresh.cache.decode_kernel = "aten"
        whole = fresh.submit(context, params)
        fresh.run()
        out[kernel + "_reentry"] = [(r.samples[0].token_ids, r.samples[0].log_probs)
                                    for r in (again, whole, other)] + [eng.decode_fed_tokens]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out["hf"] = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                 for p in prompts]
    return out


def test_engine_through_the_kernel_equals_sdpa_and_transformers(hf_models):
    from parallel_models.testing import run_distributed

    out = run_distributed(_engine_tokens, 1, hf_models[("llama", "causal_lm")], timeout=300)[0]
    for (tok_a, lp_a), (tok_t, lp_t), (tok_r, lp_r), ref in zip(
            out["aten"], out["triton"], out["triton_rope_apart"], out["hf"]):
        assert tok_t == tok_r == tok_a == ref
        assert max(abs(a - b) for a, b in zip(lp_a, lp_t)) < 1e-5
        assert max(abs(a - b) for a, b in zip(lp_a, lp_r)) < 1e-5
    for kernel in ("aten", "triton", "triton_rope_apart"):
        (tok_fed, lp_fed), (tok_whole, lp_whole), (tok_other, _), fed = out[kernel + "_reentry"]
        assert fed == 5 and tok_fed == tok_whole and tok_other == out["aten"][2][0]
        assert max(abs(a - b) for a, b in zip(lp_fed, lp_whole)) < 1e-5


def test_split_size_fills_the_gpu_without_needless_splits(monkeypatch):
    from parallel_models.inference.split_kv_attention import split_size

    monkeypatch.delenv("PARALLEL_MODELS_DECODE_SPLIT", raising=False)
    # "cpu" counts 4 SMs: 8 programs wanted
    assert split_size(64, 8, 384, "cpu") == 512     # 512 programs already: one split per row
    assert split_size(1, 2, 384, "cpu") == 128      # 4 splits wanted: 96 -> 128 per split
    assert split_size(1, 1, 100, "cpu") == 64       # never below one tile
    monkeypatch.setenv("PARALLEL_MODELS_DECODE_SPLIT", "32")
    assert split_size(64, 8, 384, "cpu") == 32


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from parallel_models.inference import split_kv_kernels as K
types = dict(Q="*bf16", KNew="*bf16", VNew="*bf16", KPool="*bf16", VPool="*bf16",
             Offsets="*i64", Used="*i32", Back="*i32", Out="*bf16", PartOut="*fp32", PartLse="*fp32",
             Cos="*bf16", Sin="*bf16", KScale="*fp32", VScale="*fp32", scale="fp32")
types.update({n: "i32" for n in K.split_kernel.arg_names if n.startswith("stride")})
for split, splits, rope, fp8 in ((512, 1, False, False), (128, 3, True, False),
                                 (128, 3, True, True)):  # fp8: e4m3 pools with scales
    consts = dict(G=2, BLOCK_G=16, D=128, BLOCK_N=64, SPLIT=split, NUM_SPLITS=splits, H=16,
                  IEEE=False, RUNTIME_LOOP=True, ROPE=rope, MAX_BACK=0, FP8_KV=fp8,
                  INTERPRETED=False, PDL=True)  # (dependent launch, as on Hopper)
    pools = dict(KPool="*fp8e4nv", VPool="*fp8e4nv") if fp8 else {}
    sig = {n: "constexpr" if n in consts else pools.get(n, types[n])
           for n in K.split_kernel.arg_names}
    triton.compile(ASTSource(K.split_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4, num_stages=2))
consts = dict(H=16, D=128, SPLIT=128, NUM_SPLITS=3, BLOCK_S=4, PDL=True)
types = dict(PartOut="*fp32", PartLse="*fp32", Used="*i32", Out="*bf16", stride_ob="i32",
             stride_oh="i32")
sig = {n: "constexpr" if n in consts else types[n] for n in K.combine_kernel.arg_names}
triton.compile(ASTSource(K.combine_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
               options=dict(num_warps=4))
print("compiled")
"""


def test_gpu_kernels_compile_for_hopper():
    """The compiled form (runtime-bound loop, not the interpreter's) through Triton's whole
    pipeline to an sm_90 binary with its bundled ptxas, no GPU needed."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True,
                         timeout=240)
    if "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("triton without its bundled ptxas")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_self_check_passes_and_refuses_odd_head_dims():
    from parallel_models.inference.split_kv_attention import rope_supported, supported

    assert supported(torch.device(DEV), torch.float32, 2, 16)  # what PoolKVCache asks on CUDA
    assert rope_supported(torch.device(DEV), torch.float32, 2, 16)  # the in-kernel RoPE too
    assert not supported(torch.device(DEV), torch.float32, 2, 24)  # head_dim not a power of 2


@pytest.mark.parametrize("env", ["16,2,1", "32,8,3,32", "128,4,2"])
def test_launch_configs_match_sdpa(monkeypatch, env):
    """Each tile / split setting (PARALLEL_MODELS_DECODE_KERNEL_CONFIG) computes the same
    attention (the interpreter ignores warps and stages; the GPU test times them)."""
    monkeypatch.setenv("PARALLEL_MODELS_DECODE_KERNEL_CONFIG", env)
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, max_row, used = 4, 2, 16, 70, [1, 31, 70]
    pool = max_row * len(used)
    k_pool, v_pool = torch.randn(pool, kv_heads, d, generator=g), torch.randn(pool, kv_heads, d,
                                                                               generator=g)
    q = torch.randn(len(used), heads, d, generator=g)
    k_new, v_new = torch.randn(2, len(used), kv_heads, d, generator=g)
    offsets = torch.arange(len(used)) * max_row
    used_t = torch.tensor(used, dtype=torch.int32)
    ref = reference_decode(q, k_new, v_new, k_pool.clone(), v_pool.clone(), offsets, used_t, 0.3)
    got = split_kv_decode(q.to(DEV), k_new.to(DEV), v_new.to(DEV), k_pool.to(DEV),
                          v_pool.to(DEV), offsets.to(DEV), used_t.to(DEV), max_row, 0.3)
    assert (got.cpu() - ref).abs().max().item() < 1e-5


def test_rope_in_the_kernel_matches_rotary_then_attention():
    """PARALLEL_MODELS_DECODE_FUSE_ROPE: q and the new k rotated inside the kernel give the
    attention of the rotated q / k (llama's apply_rotary) and store the rotated k in the pool."""
    from parallel_models.llama.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(9)
    heads, kv_heads, d, max_row, used = 4, 2, 16, 40, [1, 17, 40]
    rows, pool = len(used), max_row * len(used)
    k_pool, v_pool = torch.randn(pool, kv_heads, d, generator=g), torch.randn(pool, kv_heads, d,
                                                                               generator=g)
    q = torch.randn(rows, heads, d, generator=g)
    k_new, v_new = torch.randn(2, rows, kv_heads, d, generator=g)
    angles = torch.tensor(used)[:, None] * torch.rand(d // 2, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    offsets = torch.arange(rows) * max_row
    used_t = torch.tensor(used, dtype=torch.int32)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    ref = reference_decode(apply_rotary(q, cos, sin), apply_rotary(k_new, cos, sin), v_new,
                           k_ref, v_ref, offsets, used_t, 0.3)
    got = split_kv_decode(q.to(DEV), k_new.to(DEV), v_new.to(DEV), k_pool.to(DEV),
                          v_pool.to(DEV), offsets.to(DEV), used_t.to(DEV), max_row, 0.3, split=16,
                          rope=(cos.to(DEV), sin.to(DEV)))
    assert (got.cpu() - ref).abs().max().item() < 1e-5
    if DEV == "cpu":
        assert (k_pool - k_ref).abs().max().item() < 1e-6 and torch.equal(v_pool, v_ref)


@pytest.mark.parametrize("rope", [False, True])
def test_a_rows_entries_fed_in_one_step_read_each_other_not_the_pool(rope):
    """A re-entry's new tokens fed in one step (``back``: decode_layout) are consecutive entries
    of one region: each attends to the pool before the first and to its earlier entries' new k / v
    (in the kernel: from ``k_new``, not the pool other programs are writing), as SDPA over the
    tokens written in order; splits cut through the fed run; rows around it decode as usual."""
    from parallel_models.llama.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, max_row = 4, 2, 16, 64
    # row A: 1 entry; row B: 5 entries at positions 28..32 (a split boundary at 32); row C: 1
    offsets = torch.tensor([0, 64, 64, 64, 64, 64, 128])
    used_t = torch.tensor([9, 29, 30, 31, 32, 33, 40], dtype=torch.int32)
    back = torch.tensor([0, 0, 1, 2, 3, 4, 0], dtype=torch.int32)
    rows = len(used_t)
    k_pool = torch.randn(200, kv_heads, d, generator=g)
    v_pool = torch.randn(200, kv_heads, d, generator=g)
    k_pool[64 + 28:64 + 40] = 7.0  # stale values where the fed entries go: must not be read
    q = torch.randn(rows, heads, d, generator=g)
    k_new, v_new = torch.randn(2, rows, kv_heads, d, generator=g)
    angles = used_t[:, None].float() * torch.rand(d // 2, generator=g)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q_ref, k_ref_new = (apply_rotary(q, cos, sin), apply_rotary(k_new, cos, sin)) if rope \
        else (q, k_new)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    ref = reference_decode(q_ref, k_ref_new, v_new, k_ref, v_ref, offsets, used_t, 0.3)
    got = split_kv_decode(q.to(DEV), k_new.to(DEV), v_new.to(DEV), k_pool.to(DEV),
                          v_pool.to(DEV), offsets.to(DEV), used_t.to(DEV), max_row, 0.3, split=16,
                          rope=(cos.to(DEV), sin.to(DEV)) if rope else None, back=back.to(DEV))
    assert (got.cpu() - ref).abs().max().item() < 1e-5
    if DEV == "cpu":  # every entry's k / v landed at its position
        assert (k_pool - k_ref).abs().max().item() < 1e-6 and torch.equal(v_pool, v_ref)
