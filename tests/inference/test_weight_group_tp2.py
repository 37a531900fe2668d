"""``rollout.weight_push: group`` to a TP=2 rollout server: both server ranks join the group
(3 members with the trainer) and receive every bucket; the server then serves exactly what it
serves after loading the same folder (equal log-probs), and the next push reuses the group."""

from parallel_models.distributed import free_port
from parallel_models.inference.server.client import RolloutClient
from parallel_models.testing import run_distributed
from tests.helpers import weight_group_checks
from tests.helpers.server_launch import start_server, stop_server


def _greedy(client, prompts):
    out = client.generate(prompts, greedy=True, max_new_tokens=6, ignore_eos=True,
                          return_text=False)
    return [(r["samples"][0]["token_ids"], r["samples"][0]["log_probs"])
            for r in out["results"]], out["weight_version"]


def test_tp2_server_group_push_equals_folder_load(tmp_path):
    from parallel_models.testing import save_tiny_hf_model

    paths = [save_tiny_hf_model(str(tmp_path / f"m{seed}"), "llama", seed=seed)
             for seed in (1, 2)]
    prompts = [[1, 5, 9, 20], [1, 7, 3], [1, 11, 12, 13, 14, 15, 16]]
    port = free_port()
    proc = start_server(paths[0], port, tp=2, log_path=str(tmp_path / "server.log"))
    client = RolloutClient(f"http://127.0.0.1:{port}", timeout=60)
    try:
        before, version = _greedy(client, prompts)
        out = run_distributed(weight_group_checks.push_group, 1, paths[1],
                              f"http://127.0.0.1:{port}", pushes=2)[0]
        assert out.get("versions") == [version + 1, version + 2], out
        pushed, now = _greedy(client, prompts)
        assert now == version + 2 and pushed != before
        client.update_weights(paths[1])
        assert _greedy(client, prompts)[0] == pushed  # bit for bit
        assert client.weights_group("status")["transport"] == "gloo"
    finally:
        client.close()
        stop_server(proc)
