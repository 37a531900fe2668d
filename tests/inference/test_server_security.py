"""Issue 30, server items: requests a web page, a wrong folder or a bad body can send end in a
clear refusal, never a 5xx or a silent wrong result. The real app in-process (TestClient), one
tiny Llama; each check compares against what today's main did (in the issue).

1. cross-site: non-JSON content types, foreign Host (DNS rebinding), foreign Origin, admin
   endpoints off by default;
2. /weights_group/init: allowed peers only, the join off the batcher, ``timeout_s`` honoured;
3. /update_weights: a folder of another model (layers, heads) or with extra tensors refused;
4. an index whose shard path leaves the folder refused;
5. lone surrogates and deep nesting -> 400; 5xx bodies carry no exception text;
6. temperature inf / 1e30, seeds out of [0, 2^62) and empty prompts ("" as []) refused.
"""

import pytest

from parallel_models.testing import run_distributed
from tests.helpers import server_checks


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    paths = [server_checks.tiny_builtin_model(str(root / f"m{s}"), s) for s in (1, 2)]
    bad = server_checks.bad_weight_folders(root, paths[0])
    return run_distributed(server_checks.security_checks, 1, paths, bad, [1, 10, 20, 30])[0]


def _error(answer) -> str:
    body = answer[1]
    err = body.get("error") if isinstance(body, dict) else body
    return err["message"] if isinstance(err, dict) else str(err)


def test_admin_endpoints_off_by_default(res):
    assert res["default_generate"][0] == 200
    for path in ("/shutdown", "/update_weights", "/weights_group/init", "/weights_group/status"):
        status, _ = res[f"default_admin {path}"]
        assert status == 403, (path, res[f"default_admin {path}"])
        assert "--enable-admin" in _error(res[f"default_admin {path}"])


def test_cross_site_requests_refused(res):
    assert res["text_plain"][0] == 415 and "application/json" in _error(res["text_plain"])
    assert res["v1_text_plain"][0] == 415
    assert res["form_shutdown"][0] == 415
    assert res["no_type_body"][0] == 415
    assert res["evil_origin_shutdown"][0] == 403 and "Origin" in _error(res["evil_origin_shutdown"])
    assert res["evil_origin_generate"][0] == 403
    assert res["rebound_host"][0] == 400 and "Host" in _error(res["rebound_host"])
    assert res["same_origin"][0] == 200
    assert res["allowed_origin"][0] == 200 and res["allowed_origin"][2] == "http://app.example"
    assert res["preflight"] == (200, "http://app.example")
    assert res["health"]["status"] == "ok"  # nothing above shut it down


def test_weights_group_join_is_bounded_and_off_the_batcher(res):
    assert res["far_peer"][0] == 403 and "--allowed-weight-peers" in _error(res["far_peer"])
    assert res["join"][0] == 202
    status, seconds = res["generate_during_join"]
    assert status == 200 and seconds < 2.5, f"generation waited {seconds:.1f} s on the join"
    assert 2.5 < res["join_settled_after"] < 6.0, res["join_settled_after"]
    last = res["join_status"]["last"]
    assert last["kind"] == "join" and not last["ok"] and not res["join_status"]["joined"], last


@pytest.mark.parametrize("name,words", [
    ("three_layers", ["num_layers: folder 3, served 2"]),
    ("eight_heads", ["num_attention_heads: folder 8, served 4", "head_dim"]),
    ("extra_tensor", ["model.layers.7.mlp.up_proj.weight: not a tensor of this model"]),
    ("escape", ["leaves the folder"])])
def test_update_weights_refuses_other_models(res, name, words):
    status, body = res[f"update {name}"]
    assert status == 400, body
    for w in words:
        assert w in _error(res[f"update {name}"]), _error(res[f"update {name}"])
    assert "version 0 kept" in _error(res[f"update {name}"])
    assert res["update good"][0] == 200 and res["update good"][1]["weight_version"] == 1


def test_shard_path_outside_the_folder_refused(tmp_path):
    import json

    from parallel_models.llama.checkpoint_utils.errors import CheckpointError
    from parallel_models.llama.checkpoint_utils.hf_format import SafetensorsCheckpoint

    (tmp_path / "w").mkdir()
    for target in ("../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors"):
        with open(tmp_path / "w" / "model.safetensors.index.json", "w") as f:
            json.dump({"weight_map": {"a": target}}, f)
        with pytest.raises(CheckpointError, match="leaves the folder"):
            SafetensorsCheckpoint(str(tmp_path / "w"))


def test_bad_bodies_are_400_and_5xx_hide_internals(res):
    bad = {k: v for k, v in res.items() if k.startswith("bad body")}
    assert len(bad) == 6
    for key, answer in bad.items():
        assert answer[0] == 400, (key, answer)
    assert any("surrogate" in _error(a) for a in bad.values())
    assert any("nested too deep" in _error(a) for a in bad.values())
    status, body = res["internal_error"]
    assert status == 500 and "secret" not in str(body) and "RuntimeError" not in str(body), body


def test_out_of_range_values_and_empty_prompts(res):
    for name in ("temperature_inf", "temperature_nan"):
        assert res[f"range {name}"][0] == 400, res[f"range {name}"]
    assert res["range temperature_1e30"][0] == 422
    assert "temperature" in _error(res["range temperature_1e30"])
    assert res["range empty_text"][0] == res["range empty_ids"][0] == 422
    assert "empty" in _error(res["range empty_text"])
    assert res["range v1_empty_text"][0] == 400 and "empty" in _error(res["range v1_empty_text"])
    for seed in (-1, 1 << 62, 1 << 63, 1 << 64, 1 << 100):
        assert res[f"seed {seed}"][0] == 422 and "seed" in _error(res[f"seed {seed}"])
        assert res[f"v1 seed {seed}"][0] == 400, res[f"v1 seed {seed}"]
    a, b, c = res["seeded_draws"]
    assert a != b and a != c and b != c, "distinct seeds gave the same draws"


def test_cli_security_flags(tmp_path, capsys):
    from parallel_models.inference.server import cli

    (tmp_path / "config.json").write_text("{}")
    for argv, words in ((["--host", "0.0.0.0", "--enable-admin"], "--enable-admin"),
                        (["--allowed-origins", "app.example"], "--allowed-origins"),
                        (["--allowed-weight-peers", "host:notaport"], "--allowed-weight-peers")):
        assert cli.main(["--model", str(tmp_path), *argv]) == 2
        assert words in capsys.readouterr().err
