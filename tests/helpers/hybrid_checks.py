"""Workers for the hybrid-engine tests (run on gloo ranks): weight sync from a TP x PP training
layout into TP' rollout models, compared with a fresh load of the actor's saved folder; PPO
steps at a layout, returning their metrics."""

from __future__ import annotations


def _perturb(chunks, scale: float) -> None:
    """Move every weight by a deterministic function of its shape (equal on the replicas of a
    replicated tensor), so the rollout model cannot pass by still holding the loaded weights."""
    import torch

    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.add_(scale * torch.sin(torch.arange(p.numel(), dtype=p.dtype)).view(p.shape))


class CountingAllocator:
    """Counts the bytes of the tensor storages that torch ops create while active (a
    ``TorchDispatchMode``: every aten op of this thread, whoever calls it) and the peak of those
    still alive. A storage is freed when the last tensor seen on it dies. Allocations inside a
    collective's backend (gloo's staging copies; NCCL has none) are not aten ops here."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list] = {}  # storage data_ptr -> [live tensors, bytes]

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def _track(self, t, input_keys: set) -> None:
        import weakref

        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes:
            return
        if key in self._refs:
            self._refs[key][0] += 1
        elif key in input_keys:
            return  # a view or in-place result of an untracked tensor (a parameter, a buffer)
        else:
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._release, key)

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)}
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        counter._track(t, inputs)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _peak_allocated_bytes(fn) -> tuple[int, object]:
    """The peak bytes of live tensors torch ops created while ``fn`` ran, and its result."""
    with CountingAllocator() as counter:
        out = fn()
    return counter.peak, out


def sync_matches_fresh_load(model_path: str, out_dir: str, tp: int, pp: int,
                            rollout_tps: list[int], bucket_bytes: int, vpp: int = 1,
                            ep: int = 1) -> dict:
    """Per rollout TP': two syncs (weights moved before each), each compared with a fresh load
    of the actor's save; the peak bytes torch allocated during each sync. ``vpp`` > 1: the
    actor is this rank's virtual-pipeline chunks; ``ep``: expert-parallel size (MoE)."""
    import os

    import torch
    import torch.distributed as dist

    import parallel_models as pm
    from parallel_models import pipeline
    from parallel_models.llama.checkpoint_utils import save_pretrained
    from parallel_models.rl.rollout.hybrid import HybridRollout

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     virtual_pipeline_parallel_size=vpp if vpp > 1 else None,
                     expert_model_parallel_size=ep)
    arch = pm.registry.architecture_of(model_path)
    cls = pm.get_model_class(arch, "causal_lm", rmpad=True, pp=pp > 1)
    actor = (pipeline.build_pipeline_chunks(cls, model_path, dtype=torch.float32) if vpp > 1
             else [cls.from_pretrained(model_path, dtype=torch.float32)])
    results = {}
    for rollout_tp in rollout_tps:
        hybrid = HybridRollout(actor, rollout_tp, bucket_bytes=bucket_bytes)
        sync = hybrid.weight_sync
        out = {"mismatch": [], "peaks": [], "buckets": len(sync.buckets)}
        target = hybrid.engine.model
        for step in range(2):  # the second sync reuses the first one's buffers
            _perturb(actor, 0.01 * (step + 1))
            kept = sync._bucket_buf.data_ptr() if sync._bucket_buf is not None else None
            peak, _ = _peak_allocated_bytes(lambda: hybrid.sync(version=step))
            out["peaks"].append(peak)
            if kept is not None:
                out["buffers_reused"] = kept == sync._bucket_buf.data_ptr()
            folder = os.path.join(out_dir, f"actor_tp{rollout_tp}_{step}")
            save_pretrained(actor, folder, overwrite=True)
            fresh = pm.get_model_class(arch, "causal_lm", rmpad=True).from_pretrained(
                folder, dtype=torch.float32, layout=hybrid.layout)
            mine = dict(target.named_parameters())
            for name, p in fresh.named_parameters():
                if not torch.equal(p, mine[name]):
                    out["mismatch"].append((step, name, (p - mine[name]).abs().max().item()))
            dist.barrier()
        out["buffer_bytes"] = sync.buffer_bytes
        out["largest_tensor_bytes"] = max(
            4 * int(torch.Size(s).numel()) for b in sync.buckets for j in b.jobs
            for s in j.mapping.rule.hf_shapes(sync.config))
        out["model_bytes"] = sum(4 * b.numel for b in sync.buckets)
        results[rollout_tp] = out
    return results


def released_copy_rolls_out_like_resident(model_path: str) -> dict:
    """PP=2 actor, rollout at TP'=1: a hybrid engine that releases its rollout copy between
    rollouts (``offload``: parameters freed, not copied) against one that keeps it, greedy
    rollouts after weight changes and at an unchanged version; what the released copy holds
    between rollouts and how many syncs each ran."""
    import torch

    import parallel_models as pm
    from parallel_models.inference import SamplingParams
    from parallel_models.rl.rollout.hybrid import HybridRollout
    from parallel_models.rl.rollout.hybrid_adapter import HybridEngineRollout

    pm.init_parallel(pipeline_parallel_size=2)
    cls = pm.get_model_class(pm.registry.architecture_of(model_path), "causal_lm", rmpad=True,
                             pp=True)
    actor = [cls.from_pretrained(model_path, dtype=torch.float32)]
    resident = HybridRollout(actor, 1)
    released = HybridRollout(actor, 1, release_copy=True)
    syncs = {"resident": 0, "released": 0}
    for name, h in (("resident", resident), ("released", released)):
        inner = h.weight_sync.sync

        def counted(inner=inner, name=name):
            syncs[name] += 1
            return inner()
        h.weight_sync.sync = counted

    def held_bytes() -> int:
        return sum(p.untyped_storage().nbytes() for p in released.engine.model.parameters())

    params = SamplingParams(max_new_tokens=6, greedy=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = {"held_at_start": held_bytes(), "equal": [], "held_between": [], "changed": None}
    adapter = HybridEngineRollout(released)
    first = None
    for step, version in enumerate([0, 1, 1, 2]):
        if step in (1, 3):
            _perturb(actor, 0.05)
        want = resident.rollout(prompts, params, version=version)
        if step == 2:  # through the rollout interface: resume, generate, release
            adapter.update_weights(version)
            adapter.resume_memory()
            got = adapter.generate(prompts, params)
            adapter.release_memory()
        else:
            got = released.rollout(prompts, params, version=version)
        out["equal"].append(all(torch.equal(got[k], want[k])
                                for k in ("sequences", "rollout_log_probs")))
        out["held_between"].append(held_bytes())
        if first is None:
            first = want["sequences"].clone()
        elif step == 1:
            out["changed"] = not torch.equal(first, want["sequences"])
    out["syncs"] = syncs
    return out


def ppo_metrics(output_dir: str, overrides: list[str], report_engine: bool = False) -> list[dict]:
    """``trainer.fit()`` of a short seeded PPO run with ``overrides``; its metrics per step
    (``report_engine``: with ``_rollout_continuous``, whether the rollout batched continuously)."""
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={output_dir}", "trainer.save_every=0",
                             "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false",
                             *overrides])
    cfg.validate()
    trainer = PPOTrainer(cfg)
    rows = trainer.fit()
    for row in rows if report_engine else []:  # how the rollout ran (tests/hybrid_ppo_runs.metrics_at takes it out)
        # the in-process or the hybrid engine (the server backend has none here: False)
        engine = getattr(trainer.rollout, "engine", None)
        row["_rollout_continuous"] = bool(getattr(engine, "continuous", False))
    return rows


def push_from_layout(model_path: str, url: str, tp: int, pp: int, fallback_folder: str | None
                     ) -> dict:
    """Load ``model_path`` at TP x PP and push it to the server at ``url`` as a stream (with
    ``fallback_folder``: through ``push_actor_weights``, the folder as fallback). -> the new
    version, or the error every rank raised."""
    import torch

    import parallel_models as pm
    from parallel_models.inference.server.client import RolloutClient
    from parallel_models.inference import push_actor_weights
    from parallel_models.inference.server.weight_stream import push_weight_stream

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    arch = pm.registry.architecture_of(model_path)
    actor = pm.get_model_class(arch, "causal_lm", rmpad=True, pp=pp > 1).from_pretrained(
        model_path, dtype=torch.float32)
    client = RolloutClient(url, timeout=60)
    try:
        if fallback_folder is None:
            return {"version": push_weight_stream(actor, client, bucket_bytes=16 * 1024)}
        return {"version": push_actor_weights(actor, client, fallback_folder)}
    except Exception as err:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(err).__name__}: {err}"}
