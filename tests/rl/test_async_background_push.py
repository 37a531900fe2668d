"""The background weight push of an async run (``inference/server/background_push.py``): the
trainer's ``push`` returns once the weights are snapshotted; the stream sent afterwards carries
exactly the HF tensors of the pushed weights (the model's safetensors, bit for bit) even when
the trainer changes its weights meanwhile; the policy versions learn the server's version on
its answer; a failed push is raised on the trainer's side, naming the cause."""

from __future__ import annotations

import threading

import pytest
import torch


class _Server:
    """``push_weight_stream`` of a server: parses the frames (after ``go`` is set)."""

    def __init__(self, version: int = 7, fail: bool = False):
        self.url, self.version, self.fail = "http://test", version, fail
        self.go = threading.Event()
        self.tensors: dict | None = None

    def push_weight_stream(self, body):
        from parallel_models.inference.server.weight_stream import StreamParser

        assert self.go.wait(30)
        if self.fail:
            raise ConnectionError("connection refused")
        parser = StreamParser()
        for frame in body:
            parser.feed(frame)
        self.tensors = {k: v.clone() for k, v in parser.finish().items()}
        return {"weight_version": self.version}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import parallel_models as pm
    from parallel_models.testing import save_tiny_hf_model

    pm.init_parallel()
    path = save_tiny_hf_model(str(tmp_path_factory.mktemp("m") / "m"), "llama", seed=3)
    yield path, pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    pm.destroy_parallel()


def test_the_stream_is_the_snapshot_whatever_the_trainer_does_next(model):
    from safetensors.torch import load_file

    from parallel_models.inference import BackgroundPush
    from parallel_models.rl.async_rollout.versions import PolicyVersions

    path, actor = model
    server, versions = _Server(), PolicyVersions()
    pusher = BackgroundPush(actor, server, versions.pushed, versions.wake)
    pusher.push(3)  # returns with the send still held by the server
    assert pusher.in_flight and versions.trainer_version(7) is None
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1.0)  # the next update, while the push is under way
    server.go.set()
    pusher.wait()
    assert versions.current == 3 and versions.trainer_version(7) == 3
    want = load_file(f"{path}/model.safetensors")
    assert server.tensors.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(server.tensors[name], tensor.float()), name
    assert set(pusher.seconds) == {"push_wait_s", "snapshot_s", "push_s"}
    with torch.no_grad():
        for p in actor.parameters():
            p.sub_(1.0)


def test_a_failed_push_is_raised_to_the_trainer(model):
    from parallel_models.inference import BackgroundPush
    from parallel_models.rl.async_rollout.versions import PolicyVersions

    server, versions = _Server(fail=True), PolicyVersions()
    pusher = BackgroundPush(model[1], server, versions.pushed, versions.wake)
    pusher.push(1)
    server.go.set()
    with pytest.raises(RuntimeError, match="push to http://test failed .*ConnectionError"):
        pusher.push(2)  # the next push waits for this one first
    assert versions.current is None
