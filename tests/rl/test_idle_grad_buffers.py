"""``trainer.release_idle_grads``: the trainable roles' DDP gradient buffers freed outside their
update phases (``utils/idle_grad_buffers.py``) change nothing the run computes: the buffers come
back zeroed with their ``main_grad`` views intact, and PPO with a critic at DP=2 on the
distributed optimizer gives the same metrics, bit for bit, with and without it, across a
checkpoint and a resume."""

from __future__ import annotations

import re

import torch

from parallel_models.testing import run_distributed
from tests.helpers.ppo_runs import run_metrics, run_ppo_ranks


def _buffers_worker(path: str) -> dict:
    import parallel_models as pm
    from parallel_models.pipeline import train_step
    from parallel_models.utils.idle_grad_buffers import IdleGradBuffers
    from parallel_models.utils.optimizer import OptimConfig, build_optimizer

    pm.init_parallel(tensor_parallel_size=1)
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    ids = torch.randint(1, 100, (12,), generator=torch.Generator().manual_seed(0))
    mb = {"input_ids": ids, "cu_seqlens": torch.tensor([0, 5, 12], dtype=torch.int32),
          "max_seqlen": 7, "position_ids": torch.cat([torch.arange(5), torch.arange(7)])}

    def loss_fn(out, mb):
        loss = out.logits.float().logsumexp(-1).sum()
        return loss, torch.tensor(12), {"loss": loss.detach()}

    res = {}
    for release in (False, True):
        torch.manual_seed(0)
        model = cls.from_pretrained(path, dtype=torch.float32)
        state = build_optimizer([model], OptimConfig(lr=1e-2, clip_grad=1.0))
        idle = IdleGradBuffers(state.chunks)
        train_step(state, [dict(mb)], loss_fn)
        if release:
            bufs = idle.buffers()
            res["sizes"] = [g.untyped_storage().nbytes() for g in bufs]
            res["freed"] = idle.release()
            res["after_release"] = [g.untyped_storage().nbytes() for g in bufs]
            res["released_twice"] = idle.release()  # (nothing left to free)
            w = next(p for p in model.parameters() if hasattr(p, "main_grad"))
            with idle.in_use():
                res["zeroed"] = all(bool((g == 0).all()) for g in bufs)
                w.main_grad.fill_(3.0)  # a view of the buffer's storage still
                res["view_writes_buffer"] = any(bool((g == 3.0).any()) for g in bufs)
                out = train_step(state, [dict(mb)], loss_fn)
            res["released_after_update"] = idle.released
        else:
            out = train_step(state, [dict(mb)], loss_fn)
        res[release] = (out["grad_norm"], {k: v.clone() for k, v in model.state_dict().items()
                                           if torch.is_tensor(v)})
    return res


def test_buffers_released_restored_zeroed_and_the_next_step_unchanged(hf_models):
    res = run_distributed(_buffers_worker, 1, hf_models[("llama", "causal_lm")])[0]
    assert res["sizes"] and min(res["sizes"]) > 0
    assert res["freed"] == sum(res["sizes"]) and res["after_release"] == [0] * len(res["sizes"])
    assert res["released_twice"] == 0
    assert res["zeroed"] and res["view_writes_buffer"] and res["released_after_update"]
    (norm, weights), (norm_r, weights_r) = res[False], res[True]
    assert norm == norm_r
    for k, v in weights.items():
        assert torch.equal(v, weights_r[k]), k


COMMON = ["algorithm.adv_estimator=gae", "critic.enable=true",
          "actor.use_distributed_optimizer=true", "critic.use_distributed_optimizer=true",
          "data.batch_size=4", "rollout.n=2", "rollout.max_new_tokens=8", "actor.ppo_epochs=1",
          "actor.mini_batch_size=4",
          "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]", "trainer.log_every=1"]


def test_ppo_with_a_critic_is_unchanged_and_resumes(tmp_path):
    plain, released = tmp_path / "plain", tmp_path / "released"
    run_ppo_ranks([*COMMON, "trainer.total_steps=3", "trainer.save_every=0",
                   "trainer.release_idle_grads=false", f"trainer.output_dir={plain}"], 2)
    on = [*COMMON, "trainer.release_idle_grads=true", f"trainer.output_dir={released}"]
    log = run_ppo_ranks([*on, "trainer.total_steps=2", "trainer.save_every=2"], 2)
    freed = re.findall(r"release_idle_grads: ([0-9.]+) MiB of gradient buffers freed", log)
    assert freed and all(float(f) > 0 for f in freed), log[-2000:]  # (logged by rank 0)
    run_ppo_ranks([*on, "trainer.total_steps=3", "trainer.save_every=0", "trainer.resume=true"],
                  2)
    want, got = run_metrics(plain), run_metrics(released)
    assert [m["step"] for m in got] == [1, 2, 3]
    skip = ("timing/", "memory/", "perf/")
    for a, b in zip(want, got):
        for k, v in a.items():
            if not k.startswith(skip):
                assert b[k] == v, (a["step"], k, v, b[k])
