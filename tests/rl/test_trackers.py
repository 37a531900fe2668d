"""Experiment trackers through their own libraries, offline / local-file mode: what we log is read
back with the tracker's own reader (MLflow's client; W&B's record protobufs from the run file)."""

from __future__ import annotations

import glob
import json
import struct

import pytest

from parallel_models.rl.observe.trackers import build_trackers


def _log_three_steps(trackers):
    for step in (1, 2, 3):
        for t in trackers:
            t.log_scalars(step, {"reward/mean": 0.25 * step, "kl/coef": 0.5, "skipped": float("nan")})
    for t in trackers:
        t.log_samples(3, [{"prompt": "max 3 8=", "response": "8", "score": 1.0}])
        t.close()


def _wandb_records(path):
    """Records of a W&B transaction log: a 7-byte header, then 32 KiB blocks of
    [crc32:4][length:2][type:1][payload] chunks (full=1, first=2, middle=3, last=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, out, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def test_wandb_offline_run_holds_scalars_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = build_trackers(["jsonl", "wandb"], str(tmp_path), "pm-test", "run-a",
                              {"actor": {"lr": 0.001}})
    assert len(trackers) == 1
    _log_three_steps(trackers)
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    history = {}
    config = {}
    for rec in _wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {it.key or "/".join(it.nested_key): json.loads(it.value_json)
                     for it in rec.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind in ("config", "run"):
            cfg = rec.config if kind == "config" else rec.run.config
            config.update({it.key: json.loads(it.value_json) for it in cfg.update})
    assert [history[s]["reward/mean"] for s in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert all("skipped" not in h for h in history.values())
    assert history[3]["val/generations/_type"] == "table-file"
    run_dir = run_file.rsplit("/", 1)[0]
    table = json.load(open(f"{run_dir}/files/{history[3]['val/generations/path']}"))
    assert table["columns"] == ["prompt", "response", "score"]
    assert table["data"] == [["max 3 8=", "8", 1.0]]
    assert config["actor"] == {"lr": 0.001} or config["actor"] == {"value": {"lr": 0.001}}


def test_mlflow_local_store_holds_scalars_params_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trackers = build_trackers(["mlflow"], str(tmp_path), "pm-test", "run-b",
                              {"actor": {"lr": 0.001}, "data": {"task": "max_digit"}})
    run_id = trackers[0].run.info.run_id
    _log_three_steps(trackers)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file://" + str(tmp_path / "mlruns"))
    run = client.get_run(run_id)
    assert run.data.params == {"actor.lr": "0.001", "data.task": "max_digit"}
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "skipped" not in run.data.metrics
    table = json.loads(open(client.download_artifacts(run_id, "generations/step_000003.json",
                                                      str(tmp_path / "dl"))).read())
    assert table == {"prompt": ["max 3 8="], "response": ["8"], "score": [1.0]}


def test_unknown_logger_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown logger.*'neptune'.*jsonl, tensorboard, wandb, mlflow"):
        build_trackers(["jsonl", "neptune"], str(tmp_path), "p")
