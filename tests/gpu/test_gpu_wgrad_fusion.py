"""The fused weight-gradient accumulation on CUDA (``parallel_models/utils/wgrad_fusion.py``):
cuBLAS ``addmm`` with bf16 inputs and ``out_dtype=float32`` adds into the fp32 buffer in place,
and a bf16 model in megatron DDP gets, through it, the gradient buffers the unfused path gives
(the fused ones skip one bf16 rounding per microbatch, so they are closer to fp32)."""

from __future__ import annotations

import torch

from parallel_models.utils import wgrad_fusion


def test_fused_gemm_runs_in_place_on_cuda():
    assert wgrad_fusion.fused_gemm_works("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    dy = torch.randn(4096, 768, device="cuda", generator=g).bfloat16()
    buf = torch.randn(768, 512, device="cuda", generator=g)
    want = buf.double() + dy.double().t() @ x.double()
    ptr = buf.data_ptr()
    wgrad_fusion._accumulate(x, dy, buf)
    assert buf.data_ptr() == ptr
    assert ((buf.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_ddp_gradients_fused_equal_unfused(gpu_models, single_rank, monkeypatch):
    import parallel_models as pm
    from parallel_models.utils.optimizer import wrap_for_training
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    monkeypatch.setenv("PARALLEL_MODELS_WGRAD_FUSION", "1")
    [model] = wrap_for_training(pm.LlamaForCausalLMRmPad.from_pretrained(
        gpu_models["llama"], dtype=torch.bfloat16))
    assert wgrad_fusion.enable([model]) == 3 * 4 + 1  # 3 layers x 4 linears + the LM head
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 1001, (512,), device="cuda", generator=g)
    cu = torch.tensor([0, 200, 512], dtype=torch.int32, device="cuda")
    grads = {}
    for on in (True, False):
        wgrad_fusion.enable([model], on=on)
        model.zero_grad_buffer()
        for _ in range(2):  # two microbatches accumulate
            (-log_probs_from_packed_logits(model(ids, cu).logits, ids, cu).mean()).backward()
        grads[on] = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
    for name, fused in grads[True].items():
        unfused = grads[False][name]
        rel = ((fused - unfused).norm() / unfused.norm().clamp_min(1e-30)).item()
        assert rel < 1e-2, f"{name}: fused vs unfused main_grad rel {rel:.2e}"
