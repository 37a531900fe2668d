"""Helpers for tests and examples: spawn N gloo ranks on the CPU, build tiny HF models locally.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (1 thread each) with
the torchrun environment set, runs ``fn(*args)`` in each and returns the per-rank results; a
failing rank's traceback is raised in the parent, and a hang hits ``timeout``. On a CPU-only host
the processes are forked from a forkserver that imported torch / megatron-core / transformers
once (seconds of CPU per process otherwise, the bulk of a small check on the CPU); with a GPU
they are spawned. Each gets the caller's current environment before anything of the check is
unpickled, as a spawned process would.
``run_distributed_jobs(jobs, world_size)`` runs several such checks in one world, so the start
and the set-up are paid once. Console scripts forked the same way:
``parallel_models.console_processes``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable

from parallel_models.distributed import free_port


# imported once by the forkserver (started with the caller's environment at its first run);
# every rank is forked with them loaded. Third-party modules, then those of ours that read no
# environment variable at import (the Triton kernel modules under llama/layers/exact/ read
# TRITON_INTERPRET at import: they are imported in the rank, after its environment is set).
# A rank's or console script's imports otherwise cost it seconds of CPU (the parallel_models
# models, trainer and server modules ~1 s, matplotlib for the reward curve ~1 s).
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.tensor_parallel",
            "transformers", "transformers.modeling_utils", "safetensors.torch",
            "transformers.masking_utils", "transformers.modeling_layers",
            "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
            "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.qwen3_moe.modeling_qwen3_moe",
            "transformers.models.qwen2_moe.modeling_qwen2_moe",
            "transformers.models.mixtral.modeling_mixtral",
            "transformers.models.gemma.modeling_gemma", "httpx",
            "matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg",
            "parallel_models.llama.modeling", "parallel_models.rl.config",
            "parallel_models.rl.trainer", "parallel_models.rl.train",
            "parallel_models.rl.roles.model_roles",
            "parallel_models.inference.engine", "parallel_models.inference.server.cli",
            "parallel_models.inference.server.app", "parallel_models.inference.server.engine"]
_CTX = None


def _context():
    """forkserver on a CPU-only host; spawn where a GPU is present: the preloaded imports may
    probe CUDA (cuInit), and a child forked after that cannot use the device."""
    global _CTX
    if _CTX is None:
        import glob

        if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"):
            _CTX = mp.get_context("spawn")
        else:
            _CTX = mp.get_context("forkserver")
            _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def start_forkserver() -> None:
    """Start the forkserver (a CPU-only host) without waiting for its preload: its imports run
    on another core meanwhile (e.g. while pytest collects), not when a first process is asked."""
    if _context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _worker(rank: int, world_size: int, port: int, env: dict, payload: bytes, results) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, as spawn would give (the forkserver's may be older)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")
    try:
        import torch

        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(payload)
        out = fn(*args, **kwargs)
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit from argparse
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from parallel_models.distributed import destroy_parallel

            destroy_parallel()
        except Exception:
            pass


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 600.0, **kwargs
                    ) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` CPU ranks (gloo); returns results by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    payload = pickle.dumps((fn, args, kwargs))
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, env, payload, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while len(outs) + len(errors) < world_size:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:  # died before reporting (import or spawn bootstrap error, OOM kill)
                    raise RuntimeError(f"distributed run of {fn.__name__}: rank(s) {dead} exited "
                                       f"with code {procs[dead[0]].exitcode} without a result")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks "
                                       f"did not finish in {timeout:.0f}s") from None
                continue
            if status == "ok":
                outs[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely blocked in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError(f"distributed run of {fn.__name__} failed:\n" + "\n".join(errors))
    return [outs[r] for r in range(world_size)]


def _run_jobs(jobs: list) -> list:
    """Each job ``(fn, args, kwargs)`` in turn on this rank, every one from the random state and
    environment variables the process started with (as if it had a fresh process of its own);
    their results in order."""
    import random

    import numpy as np
    import torch

    start = torch.get_rng_state(), random.getstate(), np.random.get_state(), dict(os.environ)
    results = []
    for fn, args, kwargs in jobs:
        torch.set_rng_state(start[0])
        random.setstate(start[1])
        np.random.set_state(start[2])
        os.environ.clear()
        os.environ.update(start[3])
        try:
            results.append(fn(*args, **kwargs))
        except BaseException as err:
            raise RuntimeError(f"job {len(results)} ({fn.__name__}) failed") from err
    return results


def run_distributed_jobs(jobs: list, world_size: int, *, timeout: float = 600.0) -> list[list]:
    """Run several checks ``(fn, args)`` or ``(fn, args, kwargs)`` one after another in ONE world
    of ``world_size`` CPU ranks: the spawn and the import of torch / megatron-core /
    transformers (seconds per rank) are paid once instead of once per check. Each check sets up
    its own layout (``init_parallel`` tears down the previous groups). Returns, per job, the
    per-rank results, as ``run_distributed`` would have; the first failing job fails them all."""
    jobs = [(job[0], tuple(job[1]), dict(job[2]) if len(job) > 2 else {}) for job in jobs]
    per_rank = run_distributed(_run_jobs, world_size, jobs, timeout=timeout)
    return [[per_rank[rank][j] for rank in range(world_size)] for j in range(len(jobs))]


def run_named_jobs(named: list, *, timeout: float = 600.0) -> dict:
    """``named``: ``(name, world_size, job)`` triples. Each world size's jobs run in one world
    (:func:`run_distributed_jobs`, in the order given), the worlds at the same time (a world
    of one rank leaves the other cores free, and a rank waiting in a collective one); returns
    ``{name: per-rank results}``; the first failing world's error is raised once all ended."""
    from concurrent.futures import ThreadPoolExecutor

    worlds = sorted({w for _, w, _ in named})

    def run_world(world: int) -> dict:
        mine = [(name, job) for name, w, job in named if w == world]
        results = run_distributed_jobs([job for _, job in mine], world, timeout=timeout)
        return dict(zip([name for name, _ in mine], results))

    out = {}
    with ThreadPoolExecutor(len(worlds)) as pool:
        for done in [pool.submit(run_world, w) for w in worlds]:
            out.update(done.result())
    return out


_TINY_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_hf_config(family: str = "llama", **overrides):
    """A small transformers config of a registered family, by HF model_type: its tiny settings
    (``Family.tiny``; vocab sizes are odd so that they are never divisible by TP, head_dim
    differs from hidden/heads where the family allows it, the MoE families have a dense layer
    among their MoE layers where transformers allows one): ``llama`` (GQA, llama3 rope),
    ``qwen2`` (qkv bias, tied), ``qwen3`` (qk-norm, head_dim 24 != 64/4, tied), ``qwen3_moe``
    (4 experts top-2, layer 1 dense), ``qwen2_moe`` (+ gated shared expert, layer 1 dense),
    ``mixtral``, ``gemma`` ((1 + w) norms, GELU-tanh, scaled embeddings)."""
    import transformers

    from parallel_models.llama.families import family_of_model_type

    fam = family_of_model_type(family, default=None)  # ConfigError (a ValueError) when unknown
    kw = dict(_TINY_COMMON, **fam.tiny, architectures=[f"{fam.name}ForCausalLM"])
    kw.update(overrides)
    return getattr(transformers, fam.hf_config_class)(**kw)


def save_tiny_hf_model(path: str, family: str = "llama", *, head: str = "causal_lm",
                       seed: int = 0, dtype=None, max_shard_size: str | None = None,
                       router_scale: float | None = None, **overrides) -> str:
    """Build a random tiny HF model (CausalLM or SequenceClassification, num_labels=1) and
    ``save_pretrained`` it (safetensors) to ``path``. ``router_scale`` (MoE families): router
    weights drawn from N(0, 0.02) times it, so the top-k choice has wide margins and float
    rounding cannot flip a routing decision; a shared-expert gate from N(0, 0.2)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    if head == "value":
        config.num_labels = 1
        config.architectures = [config.architectures[0].replace("CausalLM", "SequenceClassification")]
        config.pad_token_id = 0
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    # HF's init leaves biases at zero and norms at one: randomize so tests see every tensor
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if router_scale is not None and name.endswith("mlp.gate.weight"):  # not the shared
                p.normal_(0.0, 0.02).mul_(router_scale)                         # expert's gate
            if router_scale is not None and name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.2)
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


class TensorDictReader:
    """The checkpoint reader interface (``checkpoint_utils.loader.WeightReader``) over a dict of
    full HF-named tensors in memory, e.g. a transformers model's parameters or gradients: the
    weight rules then cut the slice a rank owns, as they do from a file."""

    folder = "<tensors in memory>"

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def dtype(self, name: str):
        return self.tensors[name].dtype

    def __call__(self, name: str, dim, start, end):
        t = self.tensors[name].detach()
        return t if dim is None else t.narrow(dim, start, end - start)

