"""The rollout server with ``--quantization fp8`` (a real subprocess on the CPU, continuous
batching, the emulated FP8 GEMM): greedy answers equal the in-process FP8 engine's, before and
after ``/update_weights`` loads another folder (the server re-quantizes on load), and the OpenAI
completions endpoint answers."""

import httpx
import pytest
import torch

from parallel_models.distributed import free_port
from parallel_models.testing import run_distributed
from tests.helpers import server_checks
from tests.helpers.server_launch import start_server, stop_server

PROMPTS = [[1, 5, 9, 11], [1, 30, 31], [1, 7, 8, 9, 10, 40]]
MAX_NEW = 8


def fp8_reference(paths: list[str], prompts: list[list[int]]) -> list:
    """Per folder: each prompt's greedy (token ids, log-probs) from an in-process FP8 engine,
    the second folder loaded with ``update_weights`` as the server does."""
    import parallel_models as pm
    from parallel_models.inference import RolloutEngine
    from parallel_models.inference.sampling import SamplingParams

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(paths[0], rmpad=True, dtype=torch.float32)
    engine = RolloutEngine(model, weight_dtype="fp8", eos_token_id=server_checks.EOS)
    params = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    out = []
    for i, path in enumerate(paths):
        if i:
            engine.update_weights(path)
        per = []
        for s in [engine.generate_samples([p], params)[0] for p in prompts]:
            per.append((s["token_ids"], s["log_probs"]))
        out.append(per)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8serve")
    paths = [server_checks.tiny_builtin_model(str(root / f"m{s}"), seed=s) for s in (1, 2)]
    port = free_port()
    proc = start_server(paths[0], port, log_path=str(root / "server.log"),
                        extra=("--quantization", "fp8", "--max-new-tokens", "16"))
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    yield {"client": client, "paths": paths}
    client.close()
    stop_server(proc)


def _greedy(client, prompt):
    r = client.post("/generate", json={"prompts": [prompt], "greedy": True,
                                       "max_new_tokens": MAX_NEW, "return_text": False})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]["samples"][0]


def test_fp8_server_equals_in_process_fp8_engine_and_reloads(served):
    client, paths = served["client"], served["paths"]
    ref = run_distributed(fp8_reference, 1, paths, PROMPTS)[0]
    before = [_greedy(client, p) for p in PROMPTS]
    r = client.post("/update_weights", json={"path": paths[1]})
    assert r.status_code == 200, r.text
    after = [_greedy(client, p) for p in PROMPTS]
    for want, got in ((ref[0], before), (ref[1], after)):
        for (tokens, logps), sample in zip(want, got):
            assert sample["token_ids"] == tokens
            assert max(abs(a - b) for a, b in zip(sample["log_probs"], logps)) <= 1e-4
    assert [s["token_ids"] for s in before] != [s["token_ids"] for s in after]
    model = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None
