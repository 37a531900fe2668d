"""Hybrid engine on CUDA: generation with CUDA graphs after an in-process weight sync equals a
freshly built engine on the new weights (a captured graph must never read stale weight memory),
and the synced weights are bit-identical to a fresh load of the actor's save.

Run: ``python -m pytest -q tests/gpu/test_weight_sync_gpu.py`` (one GPU)."""

import os

import torch

import parallel_models as pm
from parallel_models.inference.engine import RolloutEngine
from parallel_models.rl.rollout.hybrid import HybridRollout
from parallel_models.inference.sampling import SamplingParams


def _move(model, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g, device=p.device,
                                                       dtype=p.dtype))


def test_generation_after_sync_equals_fresh_engine(gpu_models, single_rank, tmp_path):
    assert os.environ.get("PARALLEL_MODELS_CUDA_GRAPHS", "1") != "0", "run with CUDA graphs on"
    path = gpu_models["llama"]
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    actor = cls.from_pretrained(path, dtype=torch.float32)
    hybrid = HybridRollout(actor, 1, share_weights=False, bucket_bytes=1 << 20)
    params = SamplingParams(max_new_tokens=24, greedy=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]

    def rollout():
        return hybrid.rollout(prompts, params, version=None)["sequences"]

    hybrid.sync(version=0)
    before = rollout()  # captures (and replays) a decode graph on the first weights
    _move(actor, seed=1)  # the "update"
    hybrid.sync(version=1)
    after = rollout()
    folder = str(tmp_path / "actor")
    actor.save_pretrained(folder, overwrite=True)
    fresh = cls.from_pretrained(folder, dtype=torch.float32)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, dict(hybrid.engine.model.named_parameters())[name]), name
    out = RolloutEngine(fresh).generate(prompts, params)
    want = torch.cat([out.prompts, out.responses], dim=1)
    want = torch.where(torch.cat([out.prompt_mask, out.response_mask], 1).bool(), want, 0)
    assert not torch.equal(before, after), "the new weights did not change the greedy samples"
    assert torch.equal(after.cpu(), want.cpu())


def test_offloaded_rollout_copy_comes_and_goes(gpu_models, single_rank):
    """trainer.offload: between rollouts the rollout copy holds no parameter memory (released,
    not copied: the sync rewrites them), comes back for the sync and the generation, and
    generates what the on-device copy does."""
    path = gpu_models["qwen2"]
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    actor = cls.from_pretrained(path, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=12, greedy=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    resident = HybridRollout(actor, 1, share_weights=False)
    want = resident.rollout(prompts, params, version=0)["sequences"]
    del resident
    hybrid = HybridRollout(actor, 1, share_weights=False, release_copy=True)
    def held() -> int:
        return sum(p.untyped_storage().nbytes() for p in hybrid.engine.model.parameters())

    assert held() == 0
    got = hybrid.rollout(prompts, params, version=0)["sequences"]
    assert held() == 0
    assert torch.equal(got.cpu(), want.cpu())
