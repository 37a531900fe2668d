"""Adapter-only weight pushes (``rollout.backend=server`` with a LoRA actor): the trainer
streams its adapters, the server hangs them on its base weights; after each push the server's
greedy answers carry the actor's LoRA log-probs, and the push moves a small share of the full
model's bytes; a push whose adapters do not fit the model leaves the server as it was."""

import pytest

from parallel_models.distributed import free_port
from parallel_models.inference.server.client import RolloutClient, ServerError
from parallel_models.inference.server.weight_stream import bucket_frame, end_frame
from parallel_models.lora import LoraSettings
from parallel_models.testing import run_distributed
from tests.helpers import lora_checks
from tests.helpers.server_launch import start_server, stop_server


@pytest.fixture(scope="module")
def server(hf_models, tmp_path_factory):
    path = hf_models[("llama", "causal_lm")]
    port = free_port()
    log = str(tmp_path_factory.mktemp("lora_push") / "server.log")
    proc = start_server(path, port, extra=("--dtype", "float32"), log_path=log)
    yield path, f"http://127.0.0.1:{port}"
    stop_server(proc)


def test_server_runs_the_pushed_adapters(server):
    path, url = server
    prompts = [[1, 5, 9, 13], [1, 20, 4], [1, 7, 7, 30, 11, 2 + 40]]
    res = run_distributed(lora_checks.push_lora_to_server, 1, path, url, prompts)[0]
    first, second = res["pushes"]
    for push in (first, second):
        assert push["diff"] <= 1e-4, push  # the server computes the actor's LoRA forward
        assert push["off_base"] > 1e-2, push  # ... not the base model's
        assert push["version"] == push["pushed"], push
    assert second["version"] == first["version"] + 1
    # rank 4 on every linear of the tiny model: the adapters are a small share of the weights
    assert 0 < first["bytes"] < res["full_bytes"] / 5, res


def test_bad_adapter_push_keeps_the_served_weights(server):
    import json
    import struct

    import torch

    path, url = server
    client = RolloutClient(url, timeout=60)
    try:
        before = client.generate([[1, 5, 9]], greedy=True, max_new_tokens=4, return_text=False)
        lora = LoraSettings(rank=lora_checks.RANK, alpha=lora_checks.ALPHA).peft_config()
        tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                   torch.zeros(4, 8)}  # one matrix of the many, of a wrong shape
        header, payload = bucket_frame(tensors)
        body = json.loads(header[8:])
        body["lora"] = lora
        raw = json.dumps(body).encode()
        with pytest.raises(ServerError, match="adapter push does not fit the model"):
            client.push_weight_stream([struct.pack("<Q", len(raw)) + raw, payload,
                                       end_frame(len(tensors))])
        after = client.generate([[1, 5, 9]], greedy=True, max_new_tokens=4, return_text=False)
        assert after["weight_version"] == before["weight_version"]
        assert after["results"] == before["results"]
    finally:
        client.close()


def test_lora_ppo_through_the_server_samples_the_trained_adapters(tmp_path):
    """Two LoRA PPO steps with ``rollout.backend=server``: after the first update the trainer
    pushes its adapters, and the second step's rollouts (sampled by the server) have the
    log-probs of the training forward (the LoRA policy)."""
    from tests.helpers import server_checks
    from tests.helpers.ppo_runs import run_metrics, run_ppo

    path = server_checks.tiny_builtin_model(str(tmp_path / "model"), seed=1)
    port = free_port()
    proc = start_server(path, port, log_path=str(tmp_path / "server.log"))
    try:
        out = str(tmp_path / "run")
        run_ppo([f"trainer.output_dir={out}", f"model.path={path}", "rollout.backend=server",
                 f"rollout.server_url=http://127.0.0.1:{port}", "actor.lora.rank=8",
                 "actor.lr=1e-2", "trainer.total_steps=2", "trainer.save_every=0",
                 "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]",
                 "data.max_prompt_length=16"])
        info = RolloutClient(f"http://127.0.0.1:{port}", timeout=60)
        try:
            last = info.info().get("last_weight_push") or {}
        finally:
            info.close()
    finally:
        stop_server(proc)
    metrics = run_metrics(out)
    assert len(metrics) == 2
    assert metrics[1]["rollout/logprob_diff_max"] <= 1e-5, metrics[1]
    assert last.get("path") == "<adapter push>", last
