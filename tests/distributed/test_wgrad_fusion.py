"""Weight-gradient GEMMs accumulated straight into megatron's fp32 grad buffers
(``parallel_models/utils/wgrad_fusion.py``): the GEMM itself, the switch, and training steps with
it on against transformers + torch AdamW (2 gloo ranks). The CUDA path (cuBLAS with
``out_dtype=float32``) is checked by ``tests/gpu/test_gpu_wgrad_fusion.py``."""

import pytest
import torch

from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model
from parallel_models.utils import wgrad_fusion
from tests.helpers import pipeline_checks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_adds_the_weight_gradient_into_the_buffer(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 24, generator=gen).to(dtype)        # tokens x in
    g = torch.randn(37, 40, generator=gen).to(dtype)        # tokens x out
    buf = torch.randn(40, 24, generator=gen)
    want = buf + g.double().t().matmul(x.double()).float()
    ptr = buf.data_ptr()
    wgrad_fusion._accumulate(x, g, buf)
    assert buf.data_ptr() == ptr, "the buffer must be updated in place"
    torch.testing.assert_close(buf, want, rtol=1e-5, atol=1e-5)


def test_switch(monkeypatch):
    from parallel_models.options import env_var, options_override

    monkeypatch.delenv(env_var("wgrad_fusion"), raising=False)
    with options_override(wgrad_fusion=False):
        assert not wgrad_fusion.wanted("cuda", torch.bfloat16)
    with options_override(wgrad_fusion=True):
        assert wgrad_fusion.wanted("cpu", torch.float32)
    monkeypatch.setenv(env_var("wgrad_fusion"), "1")  # the environment variable still works
    assert wgrad_fusion.wanted("cpu", torch.float32)
    monkeypatch.delenv(env_var("wgrad_fusion"))
    assert not wgrad_fusion.wanted("cpu", torch.float32), "unfused by default"
    assert wgrad_fusion.fused_gemm_works("cpu", torch.bfloat16)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("wgrad")
    llama = save_tiny_hf_model(str(root / "llama"), "llama", seed=1, num_hidden_layers=4)
    qwen2 = save_tiny_hf_model(str(root / "qwen2"), "qwen2", seed=1, num_hidden_layers=4)
    jobs = {"llama_tp2": (llama, 2, 1, 2), "qwen2_tied_tp2": (qwen2, 2, 1, 2),
            "qwen2_tied_pp2": (qwen2, 1, 2, 2)}
    out = run_distributed_jobs([(pipeline_checks.check_fused_wgrad_train_steps, args)
                                for args in jobs.values()], 2, timeout=400)
    return dict(zip(jobs, out))


@pytest.mark.parametrize("name,gemms_per_microbatch", [
    # 4 layers x (qkv, o, gate_up, down) + the untied LM head
    ("llama_tp2", [4 * 4 + 1]),
    # the tied LM head borrows the embedding's weight, whose gradient also arrives through
    # .grad: unfused
    ("qwen2_tied_tp2", [4 * 4]),
    # 2 layers a stage; the last stage's copy of the tied LM head is its own weight (kept in
    # sync with the embedding by megatron's embedding-group all-reduce of main_grad), fused too
    ("qwen2_tied_pp2", [2 * 4, 2 * 4 + 1])])
def test_fused_training_steps_match_transformers(results, name, gemms_per_microbatch):
    for r in results[name]:
        # 2 steps of 4 microbatches (no data parallelism at 2 ranks)
        want = 2 * 4 * gemms_per_microbatch[min(r["pp_rank"], len(gemms_per_microbatch) - 1)]
        assert r["fused_gemms"] == want, (r["pp_rank"], r["fused_gemms"])
        assert r["worst_rel"] <= 1e-4, f"weights differ from HF by rel {r['worst_rel']:.2e}"
        for ours, ref in zip(r["norms"], r["hf_norms"]):
            assert abs(ours - ref) <= 1e-5 * ref, f"grad norm {ours} vs HF {ref}"
