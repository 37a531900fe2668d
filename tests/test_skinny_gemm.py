"""The skinny decode GEMM (rl/rollout/skinny_gemm.py) in Triton's CPU interpreter: bf16 outputs
within one bf16 unit in the last place of torch's fp32 product rounded once (row counts, N and K
off the tile sizes, K splits summed in-kernel, a bias), the split-K tile counters left zeroed, the
launch-config table and env var, the rule that decides when the linears use it, and the wiring:
a tiny Llama (TP=1) and a tiny Qwen2 (qkv bias, tied LM head; TP=2, the per-rank products of
column- and row-parallel linears) decoding greedily in bf16 with ``PARALLEL_MODELS_DECODE_GEMM=
triton`` give the tokens of ``cublas`` (torch's product), with the kernel really called. Skipped
without triton (not a dependency). The GPU side: tests/gpu/test_gpu_skinny_gemm.py."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from parallel_models.errors import ConfigError  # noqa: E402
from parallel_models.rl.rollout import skinny_gemm  # noqa: E402
from parallel_models.rl.rollout.skinny_gemm import (reference_linear,  # noqa: E402
                                                    skinny_linear, use_skinny)
from parallel_models.rl.rollout.skinny_gemm_config import (ENV, LaunchConfig,  # noqa: E402
                                                           TUNED, heuristic, launch_config)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|got - want|`` over one bf16 unit in the last place of ``want`` (<= 1 passes:
    the fp32 sums differ only in their order, so the roundings differ by at most one unit)."""
    want = want.float()
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(
        want.abs().clamp_min(2.0 ** -20))))
    return ((got.float() - want).abs() / ulp).max().item()


@pytest.mark.parametrize("rows,n,k,config", [
    (1, 50, 40, LaunchConfig(16, 16, 16, 1, 4, 2)),      # one row; N and K off the tiles
    (16, 64, 64, LaunchConfig(32, 16, 32, 1, 4, 2)),     # everything a whole tile
    (33, 100, 72, LaunchConfig(32, 32, 16, 4, 4, 2)),    # split 4 (uneven K), 2 M tiles, masked
    (20, 64, 128, LaunchConfig(16, 16, 32, 2, 4, 2)),    # split 2, even K, 2 M tiles
    (7, 48, 48, LaunchConfig(16, 16, 16, 8, 4, 2)),      # more splits than K tiles: capped at 3
    (40, 72, 96, None),                                  # the heuristic's config
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_matmul_rounded_once(rows, n, k, config, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).to(DEV)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(DEV) if with_bias else None
    want = reference_linear(x, w, b)
    got = skinny_linear(x, w, b, config=config)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert within_one_ulp(got, want) <= 1.0
    again = skinny_linear(x, w, b, config=config)  # the counters were left zeroed, and the
    assert torch.equal(again, got)                 # splits are summed in a fixed order


def test_leading_dims_strided_rows_and_zeroed_counters():
    """``[tokens, 1, K]`` inputs (megatron's) come back ``[tokens, 1, N]``; a row-strided view is
    read in place; after split-K calls every tile counter is zero again."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(9, 1, 80, generator=g).to(torch.bfloat16)
    x = base[..., :64]  # rows 80 apart
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    got = skinny_linear(x, w, config=LaunchConfig(16, 16, 16, 2, 4, 2))
    assert got.shape == (9, 1, 96)
    assert within_one_ulp(got, reference_linear(x, w)) <= 1.0
    assert skinny_gemm._WORKSPACES
    for _, locks in skinny_gemm._WORKSPACES.values():
        assert not locks.any()


def test_bad_operands_are_refused():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unit stride"):
        skinny_linear(x, torch.zeros(32, 16, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, torch.zeros(16, 32, dtype=torch.bfloat16),
                      torch.zeros(8, dtype=torch.bfloat16))


def test_the_rule(monkeypatch):
    """Only with PARALLEL_MODELS_DECODE_GEMM=triton (default cublas), without autograd, for
    <= 256 rows of bf16 against a bf16 [N, K] weight with unit K stride, exact mode off, and
    not where the launch-config table marks the shape as cuBLAS's (a None entry)."""
    from parallel_models.llama.layers.exact import exact_mode

    x = torch.randn(64, 1, 32).to(torch.bfloat16)
    w = torch.randn(48, 32).to(torch.bfloat16)
    monkeypatch.delenv(skinny_gemm.ENV, raising=False)
    with torch.no_grad():
        assert skinny_gemm.mode() == skinny_gemm.DEFAULT_MODE == "cublas"
        assert not use_skinny(x, w)
        monkeypatch.setenv(skinny_gemm.ENV, "cublas")
        assert not use_skinny(x, w) and skinny_gemm.decode_linear(x, w) is None
        monkeypatch.setenv(skinny_gemm.ENV, "triton")
        assert use_skinny(x, w)
        assert use_skinny(torch.randn(256, 32).to(torch.bfloat16), w)
        assert not use_skinny(torch.randn(257, 32).to(torch.bfloat16), w)  # prefill-sized
        assert not use_skinny(x.float(), w.float())
        assert not use_skinny(x, w.t().contiguous().t())  # K not the unit stride
        assert not use_skinny(x[..., :16], w)  # K mismatch
        with exact_mode():
            assert not use_skinny(x, w)
        monkeypatch.setitem(TUNED, (64, 48, 32), None)  # a sweep found cuBLAS faster there
        assert not use_skinny(x, w) and not use_skinny(x[:1], w)
        assert use_skinny(torch.randn(65, 32).to(torch.bfloat16), w)  # past the entry's rows
        monkeypatch.setitem(TUNED, (1, 48, 32), LaunchConfig(16, 16, 16, 1, 4, 2))
        assert use_skinny(x[:1], w) and not use_skinny(x[:2], w)  # the smallest entry wins
        monkeypatch.setenv(ENV, "16,16,16,1,4,2")  # a forced config overrides the table
        assert use_skinny(x, w)
        monkeypatch.delenv(ENV)
        monkeypatch.delitem(TUNED, (64, 48, 32))
        monkeypatch.delitem(TUNED, (1, 48, 32))
        y = skinny_gemm.decode_linear(x, w)
        assert y is not None and within_one_ulp(y, reference_linear(x, w)) <= 1.0
        b = torch.randn(96).to(torch.bfloat16)
        assert skinny_gemm.decode_linear(x, w, b[::2]) is None  # a strided bias: cuBLAS
    assert not use_skinny(x, w)  # autograd on: training keeps cuBLAS
    monkeypatch.setenv(skinny_gemm.ENV, "cutlass")
    with pytest.raises(ConfigError, match="PARALLEL_MODELS_DECODE_GEMM"):
        skinny_gemm.mode()
    if DEV == "cpu":
        monkeypatch.setenv(skinny_gemm.ENV, "triton")
        monkeypatch.delenv("TRITON_INTERPRET")
        with torch.no_grad():
            assert not use_skinny(x, w)  # a CPU tensor without the interpreter


def test_launch_config_sources(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    # the byte-math default at the 0.89B shapes, 132 SMs, 64 rows: N tiles of 64, K split until
    # the programs cover the SMs (o_proj 32 tiles -> 8 splits; gate_up 176 tiles -> none)
    assert heuristic(64, 2048, 2048).split_k == 8
    assert heuristic(64, 4096, 2048).split_k == 4
    assert heuristic(64, 11264, 2048).split_k == 1
    assert heuristic(64, 2048, 5632).split_k == 8
    assert heuristic(1, 32000, 2048) == LaunchConfig(64, 16, 128, 1, 4, 4)
    assert heuristic(256, 2048, 2048).block_m == 128  # two M tiles
    tuned = LaunchConfig(32, 64, 256, 2, 4, 5)
    monkeypatch.setitem(TUNED, (64, 2048, 2048), tuned)
    assert launch_config(64, 2048, 2048) == tuned == launch_config(17, 2048, 2048)
    assert launch_config(65, 2048, 2048) == heuristic(65, 2048, 2048)  # past the entry's rows
    monkeypatch.setenv(ENV, "128,32,64,1,8,3")
    assert launch_config(64, 2048, 2048) == LaunchConfig(128, 32, 64, 1, 8, 3)
    assert LaunchConfig(128, 32, 64, 1, 8, 3).as_env() == "128,32,64,1,8,3"
    for bad in ("1,2,3", "24,16,16,1,4,2", "16,16,16,0,4,2", "16,16,16,1,3,2", "a,b,c,d,e,f"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ConfigError, match=ENV):
            launch_config(4, 64, 64)


def test_self_check_passes():
    assert skinny_gemm.supported(torch.device(DEV))


def _decode_tokens(path: str, tp: int) -> dict:
    """Greedy tokens of the continuous engine (bf16) with each GEMM choice, and how many
    products the skinny kernel made."""
    import parallel_models as pm

    from parallel_models.rl.rollout.continuous import ContinuousEngine
    from parallel_models.rl.rollout.sampling import SamplingParams

    pm.init_parallel(tensor_parallel_size=tp)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 9, 14)]
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=5)
    calls = {"n": 0}
    plain = skinny_gemm.skinny_linear

    def counting(*args, **kwargs):
        calls["n"] += 1
        return plain(*args, **kwargs)

    skinny_gemm.skinny_linear = counting
    out = {}
    for name, gemm, config in (("cublas", "cublas", None), ("triton", "triton", None),
                               ("triton_split", "triton", "16,16,16,2,4,2")):
        os.environ["PARALLEL_MODELS_DECODE_GEMM"] = gemm
        os.environ.pop(ENV, None) if config is None else os.environ.__setitem__(ENV, config)
        calls["n"] = 0
        eng = ContinuousEngine(model, 120, max_rows=4, max_row_tokens=40)
        reqs = []
        for p in prompts:  # staggered: rows join a running batch
            reqs.append(eng.submit(p, params))
            eng.step()
        eng.run()
        out[name] = ([r.samples[0].token_ids for r in reqs], calls["n"])
    return out


@pytest.mark.parametrize("family,tp", [("llama", 1), ("qwen2", 2)])
def test_greedy_decoding_through_the_kernel_equals_cublas(hf_models, family, tp):
    from parallel_models.testing import run_distributed

    outs = run_distributed(_decode_tokens, tp, hf_models[(family, "causal_lm")], tp,
                           timeout=300)
    for out in outs:
        tokens, calls = out["cublas"]
        assert calls == 0
        for name in ("triton", "triton_split"):
            assert out[name][0] == tokens, name
            # every step's qkv / o / gate_up / down per layer and the LM head went through it
            assert out[name][1] >= 5 * 2 * 4
    assert all(out["cublas"][0] == outs[0]["cublas"][0] for out in outs)  # ranks agree


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from parallel_models.rl.rollout import skinny_gemm_kernels as K
types = dict(X="*bf16", W="*bf16", Bias="*bf16", Y="*bf16", Ws="*fp32", Locks="*i32", M="i32",
             N="i32", K="i32", SPLIT_K="i32", K_SPLIT="i32", M_TILES="i32", stride_xm="i32",
             stride_wn="i32", stride_ym="i32")
for n, k, bn, bm, bk, split, warps, stages, bias in (
        (2048, 2048, 64, 64, 128, 8, 4, 4, False), (32000, 2048, 64, 16, 128, 1, 4, 4, False),
        (4096, 2048, 64, 128, 64, 2, 8, 3, True), (11264, 2048, 128, 64, 128, 1, 8, 3, False)):
    k_split = -(-(-(-k // split)) // bk) * bk
    consts = dict(BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, HAS_BIAS=bias,
                  EVEN_K=k_split * split == k, EVEN_N=n % bn == 0, UPCAST=False)
    names = K.skinny_kernel.arg_names
    sig = {a: "constexpr" if a in consts else types[a] for a in names}
    # pointers and strides 16-aligned, as the JIT specializes them at run time (the loads are
    # then pipelined with async copies)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if a in types and a not in ("M", "SPLIT_K", "M_TILES")}
    ptx = triton.compile(ASTSource(K.skinny_kernel, sig, consts, attrs),
                         target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx, (n, k, bn, bm)
print("compiled")
"""


def test_gpu_kernel_compiles_for_hopper():
    """The compiled form (tensor-core dots, the ticket, the ordered split sum) through Triton's
    whole pipeline to an sm_90 binary with its bundled ptxas, no GPU needed: Hopper's wgmma and
    pipelined async copies are there."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True,
                         timeout=240)
    if "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("triton without its bundled ptxas")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
