"""The fsdp backend on CUDA: offloading a sharded model and its AdamW states to the host between
phases frees the device memory and changes nothing (the same steps as without offload), and a bf16 (mixed-precision) actor's log-probs stay within bf16 tolerance of fp32."""

from __future__ import annotations

import torch


def _actor(path, dtype="float32"):
    from parallel_models.rl.backends.fsdp import models as fm
    from parallel_models.rl.backends.fsdp.optim import build_fsdp_optimizer
    from parallel_models.utils.optimizer_config import OptimConfig

    model = fm.shard_model(fm.load_causal_lm(path), fm.device_mesh(), dtype=dtype)
    return model, build_fsdp_optimizer(model, OptimConfig(lr=1e-3))


def _step(model, state, ids):
    from parallel_models.rl.backends.fsdp.optim import fsdp_optimizer_step

    model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
    return fsdp_optimizer_step(state)["grad_norm"]


def test_offload_frees_memory_and_changes_nothing(gpu_models, single_rank):
    from parallel_models.rl.backends.fsdp.offload import FSDPOffloader

    ids = torch.randint(3, 1000, (2, 64), device="cuda")
    plain, plain_state = _actor(gpu_models["llama"])
    moved, moved_state = _actor(gpu_models["llama"])
    offloader = FSDPOffloader(moved, moved_state.optimizer)
    for _ in range(3):
        want = _step(plain, plain_state, ids)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        nbytes = offloader.offload()
        assert nbytes > 0 and torch.cuda.memory_allocated() < resident - nbytes // 2
        assert offloader.onload() == nbytes
        with offloader.on_device(with_optimizer=True):
            got = _step(moved, moved_state, ids)
        assert abs(got - want) <= 1e-5 * want  # (CUDA embedding backward: atomics)
    for (name, a), (_, b) in zip(plain.named_parameters(), moved.named_parameters()):
        assert torch.allclose(a.full_tensor(), b.full_tensor(), rtol=1e-4, atol=1e-6), name


def test_bf16_log_probs_close_to_fp32(gpu_models, single_rank):
    ids = torch.randint(3, 1000, (2, 64), device="cuda")
    out = {}
    for dtype in ("float32", "bfloat16"):
        model, _ = _actor(gpu_models["qwen2"], dtype)
        with torch.no_grad():
            out[dtype] = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(),
                                           -1)
    rel = (out["bfloat16"] - out["float32"]).norm() / out["float32"].norm()
    assert rel <= 2e-2, f"bf16 vs fp32 log-probs rel {rel:.2e}"
