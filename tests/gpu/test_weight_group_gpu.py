"""``rollout.weight_push: group`` on CUDA: a trainer and a rollout server on one GPU push through
CUDA IPC, on two GPUs through NCCL; either way the server (CUDA graphs on) then generates
exactly what it generates after loading the same weights from a folder, and a NaN weight leaves
the old version.

Run: ``python -m pytest -q tests/gpu/test_weight_group_gpu.py`` (the NCCL test needs 2 GPUs)."""

import os

import pytest
import torch

import parallel_models as pm
from parallel_models.distributed import free_port
from parallel_models.inference.server.client import RolloutClient
from parallel_models.inference.server.launch import start_server, stop_server
from parallel_models.inference.server.weight_group_push import push_weight_group
from parallel_models.inference.server.weight_stream import WeightStreamError


def _server(folder: str, log: str, gpu: int | None):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu is not None:  # this process's CUDA is initialized: only the server sees the change
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    try:
        port = free_port()
        proc = start_server(folder, port, log_path=log, extra=("--dtype", "float32"),
                            timeout=300)
    finally:
        if gpu is not None:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return proc, RolloutClient(f"http://127.0.0.1:{port}", timeout=300)


def _greedy(client, prompts):
    out = client.generate(prompts, greedy=True, max_new_tokens=16, ignore_eos=True,
                          return_text=False)
    return [(r["samples"][0]["token_ids"], r["samples"][0]["log_probs"])
            for r in out["results"]], out["weight_version"]


def _push_then_compare(gpu_models, tmp_path, server_gpu, transport):
    path = gpu_models["llama"]
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    actor = cls.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():  # the "update": the server still holds the folder's weights
        for p in actor.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g, device=p.device))
    prompts = [[1, 5, 9, 200], [1, 77, 3], [1] + list(range(10, 40))]
    proc, client = _server(path, str(tmp_path / "server.log"), server_gpu)
    try:
        before, v0 = _greedy(client, prompts)  # captures the decode graphs on the old weights
        assert push_weight_group(actor, client, bucket_bytes=1 << 20) == v0 + 1
        assert client.weights_group("status")["transport"] == transport
        pushed, v1 = _greedy(client, prompts)
        assert v1 == v0 + 1 and pushed != before, "the push did not change the samples"
        folder = str(tmp_path / "actor")
        actor.save_pretrained(folder, overwrite=True)
        client.update_weights(folder)
        assert _greedy(client, prompts)[0] == pushed  # bit for bit: equal log-probs
        with torch.no_grad():
            next(actor.parameters()).view(-1)[7] = float("nan")
        with pytest.raises(WeightStreamError, match="non-finite"):
            push_weight_group(actor, client, bucket_bytes=1 << 20)
        assert _greedy(client, prompts) == (pushed, v1 + 1)  # old version, old weights
    finally:
        client.close()
        stop_server(proc)


def test_same_gpu_push_uses_cuda_ipc(gpu_models, single_rank, tmp_path):
    _push_then_compare(gpu_models, tmp_path, None, "ipc")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_other_gpu_push_uses_nccl(gpu_models, single_rank, tmp_path):
    _push_then_compare(gpu_models, tmp_path, 1, "nccl")
