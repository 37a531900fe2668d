"""The decode step's L2 weight prefetch (``rl/rollout/l2_prefetch``): the schedule issues, in
order, each dense layer's o_proj, gate_up, down and the next qkv weight (the LM head's last),
once per decode step and never during prefill; its hooks are gone after the step; tokens and
log-probs are unchanged (fp32, CPU, the continuous engine; the prefetch itself is a Hopper
instruction, run by tests/gpu/test_gpu_l2_prefetch.py). MoE layers are skipped."""

import pytest

from parallel_models.testing import run_distributed


def _schedule(path: str) -> dict:
    import torch

    import parallel_models as pm
    from parallel_models.rl.rollout import l2_prefetch
    from parallel_models.rl.rollout.continuous import ContinuousEngine
    from parallel_models.rl.rollout.sampling import SamplingParams

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (4, 9)]
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=5)
    out = {}
    for on in (True, False):
        issued = []
        eng = ContinuousEngine(model, 64, max_rows=2)
        assert eng.prefetcher is None  # not requested (and no CUDA here)
        if on:
            pre = l2_prefetch.L2Prefetcher(
                model, max_bytes=1 << 20, issue=lambda w, n: issued.append((names[w.data_ptr()], n)))
            for step in eng._steps.values():
                step.prefetcher = pre
        reqs = [eng.submit(p, params) for p in prompts]
        eng.run()
        out[on] = [(r.samples[0].token_ids, r.samples[0].log_probs) for r in reqs]
        if on:
            out["issued"], out["steps"] = issued, eng.steps
    out["hooks_left"] = sum(len(m._forward_pre_hooks) for m in model.modules())
    out["plan"] = [(type(m).__name__, names[w.data_ptr()])
                   for m, w in l2_prefetch.prefetch_plan(model)]
    out["layers"] = len(model.model.layers)
    return out


@pytest.fixture(scope="module")
def result(hf_models):
    return run_distributed(_schedule, 1, hf_models[("llama", "causal_lm")], timeout=300)[0]


def test_prefetch_schedule_per_decode_step(result):
    layers = result["layers"]
    expected = []
    for i in range(layers):
        nxt = (f"model.layers.{i + 1}.self_attn.qkv_proj.weight" if i + 1 < layers
               else "lm_head.proj.weight")
        expected += [f"model.layers.{i}.self_attn.o_proj.weight",
                     f"model.layers.{i}.mlp.gate_up_proj.weight",
                     f"model.layers.{i}.mlp.down_proj.weight", nxt]
    issued = [name for name, _ in result["issued"]]
    assert len(issued) % len(expected) == 0 and issued, issued[:8]
    decode_steps = len(issued) // len(expected)
    assert issued == expected * decode_steps
    # one decode step per generated token after the first (drawn from the prefill's logits)
    assert 4 <= decode_steps <= result["steps"]
    assert {n for _, n in result["issued"]} == {1 << 20}
    assert result["hooks_left"] == 0


def test_prefetch_changes_no_token(result):
    assert result[True] == result[False]


def test_max_bytes_setting(monkeypatch):
    from parallel_models.rl.rollout import l2_prefetch

    monkeypatch.setenv(l2_prefetch.ENV_MAX_BYTES, "8")
    assert l2_prefetch.max_bytes_setting() == 8 << 20
    monkeypatch.setenv(l2_prefetch.ENV_MAX_BYTES, "lots")
    with pytest.raises(ValueError, match="PARALLEL_MODELS_DECODE_L2_PREFETCH_MAX_MB"):
        l2_prefetch.max_bytes_setting()
    monkeypatch.setenv(l2_prefetch.ENV, "1")
    import torch
    assert l2_prefetch.requested() and not l2_prefetch.supported(torch.device("cpu"))


def test_plan_skips_moe_layers():
    import types

    import torch

    from parallel_models.rl.rollout import l2_prefetch

    def linear():
        m = torch.nn.Linear(2, 2, bias=False)
        return m

    def layer(moe):
        attn = types.SimpleNamespace(qkv_proj=linear(), o_proj=linear())
        mlp = types.SimpleNamespace(router=linear()) if moe else types.SimpleNamespace(
            gate_up_proj=linear(), down_proj=linear())
        return types.SimpleNamespace(self_attn=attn, mlp=mlp)

    layers = [layer(False), layer(True), layer(False)]
    head = torch.zeros(4, 2)
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=layers),
                                  output_weight=lambda: head)
    plan = l2_prefetch.prefetch_plan(model)
    assert [w is x for (_, w), x in zip(plan, [
        layers[0].self_attn.o_proj.weight, layers[0].mlp.gate_up_proj.weight,
        layers[0].mlp.down_proj.weight, layers[1].self_attn.qkv_proj.weight,
        layers[2].self_attn.o_proj.weight, layers[2].mlp.gate_up_proj.weight,
        layers[2].mlp.down_proj.weight, head])] == [True] * 8
    assert len(plan) == 8


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from parallel_models.rl.rollout import l2_prefetch
sig = {"base": "*u8", "nbytes": "i64", "CHUNK": "constexpr", "THREADS": "constexpr"}
out = triton.compile(ASTSource(l2_prefetch._kernel(), sig, dict(CHUNK=16384, THREADS=128)),
                     target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print([line.strip() for line in out.asm["ptx"].splitlines() if "cp.async.bulk.prefetch" in line])
"""


def test_prefetch_kernel_compiles_for_hopper():
    """The bulk-prefetch kernel through Triton's pipeline to an sm_90 binary (bundled ptxas,
    no GPU): one predicated ``cp.async.bulk.prefetch.L2`` per thread."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True,
                         timeout=240)
    if "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("triton without its bundled ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "@p cp.async.bulk.prefetch.L2.global" in run.stdout, run.stdout
