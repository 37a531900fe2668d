"""DDP buffers written by a step's first backward (``utils/grad_first_write.py``) on CUDA, bf16:
two training steps of three microbatches (writes and adds through the Triton kernel) give the
fp32 ``main_grad`` and the updated weights of megatron's zeroed buffers + adds, within 4x the
run-to-run difference of megatron's path itself (bit for bit where that path is
deterministic; the CPU test holds the bitwise claim)."""

from __future__ import annotations

import pytest
import torch


def _train(path, first_write: str, monkeypatch):
    import os

    import parallel_models as pm
    from parallel_models.utils.optimizer import OptimConfig, build_optimizer, optimizer_step, zero_grads
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    if monkeypatch is None:  # a spawned rank
        os.environ["PARALLEL_MODELS_GRAD_FIRST_WRITE"] = first_write
    else:
        monkeypatch.setenv("PARALLEL_MODELS_GRAD_FIRST_WRITE", first_write)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.bfloat16)
    state = build_optimizer(model, OptimConfig(lr=1e-3, total_steps=2))
    ddp = state.chunks[0]
    assert ("_pm_first_write_originals" in ddp.__dict__) == (first_write == "1")
    g = torch.Generator().manual_seed(torch.distributed.get_rank())  # data differs by DP rank
    grads = []
    for _ in range(2):
        zero_grads(state)
        for _ in range(3):
            ids = torch.randint(3, 1000, (96,), generator=g).cuda()
            cu = torch.tensor([0, 40, 96], dtype=torch.int32, device="cuda")
            logits = ddp(ids, cu).logits
            (-log_probs_from_packed_logits(logits, ids, cu).sum() / 96).backward()
        ddp.finish_grad_sync()
        grads.append({n: p.main_grad.clone() for n, p in ddp.module.named_parameters()})
        optimizer_step(state)
    weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return grads, weights  # (per step {name: main_grad}, {name: weight})


def _max_diff(a: list, b: list) -> float:
    return max(float((x[n].float() - y[n].float()).abs().max()) for x, y in zip(a, b) for n in x)


def test_first_write_equals_zeroed_buffers(gpu_models, single_rank, monkeypatch):
    from parallel_models.utils import grad_buffer_kernels

    calls = []
    kernel = grad_buffer_kernels.accumulate
    monkeypatch.setattr(grad_buffer_kernels, "accumulate",
                        lambda m, g, add: (calls.append(add), kernel(m, g, add))[1])
    on = _train(gpu_models["llama"], "1", monkeypatch)
    assert calls.count(False) and calls.count(True) == 2 * calls.count(False)  # 1 write, 2 adds
    off = _train(gpu_models["llama"], "0", monkeypatch)
    off_again = _train(gpu_models["llama"], "0", monkeypatch)
    for what, i in (("main_grad", 0), ("weights", 1)):
        as_list = (lambda r: r[i]) if i == 0 else (lambda r: [r[i]])
        noise = _max_diff(as_list(off), as_list(off_again))
        got = _max_diff(as_list(on), as_list(off))
        print(f"{what}: first write vs zeroed {got:.3g}, zeroed run to run {noise:.3g}")
        assert got <= 4 * noise, (what, got, noise)  # 0 when the path is deterministic


def _dp2_worker(path):
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=1)  # 2 ranks: data parallel 2 over NCCL
    on, off, again = (_train(path, mode, None) for mode in ("1", "0", "0"))
    return {"grads": (_max_diff(on[0], off[0]), _max_diff(off[0], again[0])),
            "weights": (_max_diff([on[1]], [off[1]]), _max_diff([off[1]], [again[1]]))}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_first_write_data_parallel_2_over_nccl(gpu_models):
    """The same at DP=2 on two GPUs: the buffers are all-reduced over NCCL after the writes."""
    from parallel_models.testing import run_distributed

    for r in run_distributed(_dp2_worker, 2, gpu_models["llama"], timeout=300):
        for what, (got, noise) in r.items():
            assert got <= 4 * noise, (what, got, noise)
