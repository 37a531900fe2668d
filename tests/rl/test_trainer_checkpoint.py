"""PPO trainer checkpoints (megatron-core dist checkpoints of models and optimizers + JSON trainer
state): exact resume after a kill, resume at another TP layout, the final checkpoint, --resume of
a finished run, clear errors for folders that cannot be resumed."""

import glob
import json
import os
import stat

import pytest
import torch

from parallel_models.testing import run_distributed_jobs
from tests.helpers.chaos_runs import chaos_resume_matches
from tests.helpers.ppo_runs import assert_same_trainer_state, run_metrics as _metrics
from tests.helpers.ppo_runs import load_folder as _load_folder, run_ppo as _run
from tests.helpers import trainer_checkpoint_checks as checks

@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
def test_chaos_kills_resume_exactly_and_damage_is_refused(tmp_path):
    """14 seeded SIGKILLs at fault points (2 in start-up, 3 mid-step, 5 inside checkpoint saves,
    4 inside the final export), each followed by --resume=auto: the metrics have no gap or
    duplicate and equal an uninterrupted run's, the final actor_hf / critic_hf are
    bit-identical. Then bit flips in the final checkpoint: --resume stops with one line naming
    the file (exit 2); --resume-fallback resumes the step before, redoes the last step and ends
    with the same weights."""
    steps = 5
    common = ["trainer.total_steps=5", "trainer.save_every=1", "trainer.max_checkpoints=3",
              *[a for a in checks.TINY if "save_hf_at_end" not in a]]
    runs = chaos_resume_matches(tmp_path, common, steps=steps, seed=30)
    kinds = [k.split(":")[0] for k in runs["kills"]]
    assert len(kinds) >= 10 and kinds.count("save") >= 5 and kinds.count("start") >= 2, kinds
    assert kinds.count("step") >= 3 and kinds.count("export") + kinds.count("hf_save") >= 4, kinds
    out = runs["out"]
    data = sorted(glob.glob(os.path.join(out, "checkpoints", "step_000005", "dist", "*.distcp")))[0]
    raw = bytearray(open(data, "rb").read())
    for i in range(20):  # 20 bit flips inside the step's data, as the issue's
        raw[(len(raw) // 23) * (i + 1)] ^= 1 << (i % 8)
    with open(data, "wb") as f:
        f.write(raw)
    os.remove(os.path.join(out, "final_export.json"))  # so the resume has work to do
    proc = _run([f"trainer.output_dir={out}", *common, "--resume"], check=False)
    lines = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert proc.returncode == 2 and len(lines) == 1 and data in lines[0], proc.stderr[-3000:]
    assert "--resume-fallback" in lines[0] and "Traceback" not in proc.stderr
    proc = _run([f"trainer.output_dir={out}", *common, "--resume", "--resume-fallback"])
    assert "--resume-fallback" in proc.stderr and "step_000004" in proc.stderr
    assert [m["step"] for m in _metrics(out)] == list(range(1, steps + 1))
    for folder in ("actor_hf", "critic_hf"):
        want = _load_folder(os.path.join(runs["ref"], folder))
        got = _load_folder(os.path.join(out, folder))
        assert all(torch.equal(want[k], got[k]) for k in want), folder


def test_fault_points_are_declared_used_and_checked(monkeypatch):
    """Every fault_point("...") in the package names a declared point and every declared point
    is passed somewhere; a malformed PARALLEL_MODELS_TEST_FAULT is a ConfigError naming it,
    unset or naming another point nothing happens."""
    import re

    from parallel_models.errors import ConfigError
    from parallel_models.utils import fault_points

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                        "parallel_models")
    used = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        with open(path) as f:
            used += re.findall(r'\bfault_point\("([^"]+)"\)', f.read())
    assert sorted(set(used)) == sorted(fault_points.POINTS) and len(used) == len(set(used)), used
    monkeypatch.delenv(fault_points.ENV, raising=False)
    fault_points.fault_point("save:before_rename")  # off: nothing happens
    monkeypatch.setenv(fault_points.ENV, "save:before_rename@2")
    fault_points.fault_point("export:start")  # another point: nothing happens
    assert fault_points.parse_fault("save:before_rename@2") == ("save:before_rename", 2)
    for bad in ("save:before_renam", "save:before_rename@0", "save:before_rename@x"):
        monkeypatch.setenv(fault_points.ENV, bad)
        with pytest.raises(ConfigError, match=fault_points.ENV):
            fault_points.fault_point("export:start")


@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
def test_final_checkpoint_layout_and_finished_resume(tmp_path):
    """total_steps=3 with save_every=2 still checkpoints step 3; the folder holds a megatron
    dist checkpoint, JSON state, per-rank RNG, config.yaml, all readable by others, and `latest`
    names it; --resume of the finished run prints a summary and changes nothing."""
    out = str(tmp_path / "run")
    args = [f"trainer.output_dir={out}", "trainer.total_steps=3", "trainer.save_every=2",
            *checks.TINY]
    _run(args)
    root = os.path.join(out, "checkpoints")
    assert sorted(d for d in os.listdir(root)) == ["latest", "step_000002", "step_000003"]
    with open(os.path.join(root, "latest")) as f:
        assert json.load(f)["latest"] == "step_000003"
    final = os.path.join(root, "step_000003")
    for name in ("trainer_state.json", "config.yaml", "rng/rank_00000.json",
                 "dist/metadata.json", "dist/.metadata"):
        assert os.path.isfile(os.path.join(final, name)), name
    with open(os.path.join(final, "trainer_state.json")) as f:
        state = json.load(f)
    assert state["step"] == 3 and set(state["models"]) == {"actor", "critic"}
    from parallel_models.rl.config import load_config

    saved = load_config(os.path.join(final, "config.yaml"))  # the resolved config reloads
    assert saved.trainer.total_steps == 3 and saved.trainer.output_dir == out
    assert saved.rollout.max_new_tokens == 8
    for dirpath, _, files in os.walk(final):
        for name in files:
            mode = os.stat(os.path.join(dirpath, name)).st_mode
            assert mode & stat.S_IRGRP and mode & stat.S_IROTH, f"{name}: {oct(mode)}"
    before = {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
              for d, _, fs in os.walk(out) for f in fs}
    proc = _run([*args, "--resume"])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["finished"] is True and summary["step"] == 3
    assert summary["checkpoint"].endswith("step_000003")
    assert "reward/mean" in summary["last_metrics"]
    after = {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
             for d, _, fs in os.walk(out) for f in fs}
    assert after == before, "resuming a finished run changed files"



RESHARD = {"tp2-to-tp1": ((2, 1, 1), (1, 1, 1), "float32"),
           "pp2-to-tp2": ((1, 2, 1), (2, 1, 1), "float32"),
           "dp2-to-tp2-bf16": ((1, 1, 2), (2, 1, 1), "bfloat16"),
           # megatron's distributed optimizer: states sharded over DP=2, loaded at DP=1
           "distopt-dp2-to-tp2-bf16": ((1, 1, 2), (2, 1, 1), "bfloat16", True)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, hf_models):
    """Every distributed check of this file in two spawned worlds: the 2-rank saves (and the
    2-rank loads) first, then the 1-rank resume / loads / bad checkpoints."""
    tmp = tmp_path_factory.mktemp("trainer_ckpt")
    hf = hf_models[("qwen2", "causal_lm")]
    out2, dump2 = str(tmp / "tp2"), str(tmp / "dump_tp2")
    distopt = ("actor.use_distributed_optimizer=true", "critic.use_distributed_optimizer=true")
    out_d = str(tmp / "distopt_dp2")
    named = {1: [], 2: [("tp2_save", (checks.save_at_step2_then_step, (out2, dump2, 2))),
                        ("distopt_dp2_save", (checks.save_at_step2_then_step,
                                              (out_d, "", 1, *distopt)))]}
    for name, (save_at, load_at, dtype, *distributed) in RESHARD.items():
        folder, out = str(tmp / name / "ckpt"), str(tmp / name / "gathered")
        for (tp, pp, dp), save in ((save_at, True), (load_at, False)):  # the save goes first
            named[tp * pp * dp].append(((name, save), (checks.roles_roundtrip, (
                hf, folder, tp, pp, dtype, save, out, 1, *distributed))))
    out = {"tmp": tmp, "dump2": dump2, "hf": hf}
    out.update(zip([n for n, _ in named[2]], run_distributed_jobs([j for _, j in named[2]], 2,
                                                                  timeout=1200)))
    out1, dump1 = str(tmp / "tp1"), str(tmp / "dump_tp1")
    named[1].append(("tp1_resume", (checks.resume_then_step, (
        out1, out["tp2_save"][0]["path"], dump1, 1, os.path.join(out2, "builtin_model")))))
    named[1].append(("distopt_dp1_resume", (checks.resume_then_step, (
        str(tmp / "distopt_dp1"), out["distopt_dp2_save"][0]["path"], "", 1,
        os.path.join(out_d, "builtin_model"), *distopt))))
    (tmp / "bad").mkdir()
    named[1].append(("bad", (checks.bad_checkpoints, (str(tmp / "bad"),))))
    out.update(zip([n for n, _ in named[1]], run_distributed_jobs([j for _, j in named[1]], 1,
                                                                  timeout=1200)))
    out["dump1"] = dump1
    return out


def test_resume_tp2_checkpoint_at_tp1(worlds):
    """Save at TP=2 (2 ranks) after 2 steps, resume at TP=1 (1 rank): weights and Adam states
    (gathered) are bit-exact, and the next step's losses match the TP=2 run's within 1e-5."""
    saved, resumed = worlds["tp2_save"][0], worlds["tp1_resume"][0]
    assert resumed["step"] == 2
    assert_same_trainer_state(worlds["dump2"], worlds["dump1"])
    want, got = saved["metrics"], resumed["metrics"]
    assert want["response_length/mean"] == got["response_length/mean"], "other samples drawn"
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "reward/mean",
                "returns/mean", "actor/ppo_kl", "kl/actor_ref"):
        assert abs(want[key] - got[key]) <= 1e-5, f"{key}: TP=2 {want[key]} vs TP=1 {got[key]}"


def test_distributed_optimizer_checkpoint_resumes_at_another_dp(worlds):
    """A PPO run on the distributed optimizer (actor and critic) saved at DP=2 resumes at DP=1
    on it and trains on (the states' exactness across layouts: test_model_and_optimizer_reshard's
    distributed-optimizer case)."""
    resumed = worlds["distopt_dp1_resume"][0]
    assert resumed["step"] == 2
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
        assert resumed["metrics"][key] == resumed["metrics"][key], key  # not NaN
    assert resumed["metrics"]["actor/grad_norm"] > 0


def test_unusable_checkpoints_fail_clearly(worlds):
    messages = worlds["bad"][0]
    assert set(messages) == {"plain", "tmp", "cut", "shape", "tensor"}


@pytest.mark.parametrize("name", list(RESHARD))
def test_model_and_optimizer_reshard(worlds, name):
    """Weights and Adam states (and the fp32 main params of a bf16 model) of Qwen2 (qkv bias,
    tied embeddings, vocab 251: uneven TP rows) saved at one (TP, PP, DP) layout load exactly
    at another, with the distributed optimizer's DP-sharded states too."""
    dtype = RESHARD[name][2]
    want, got = _load_folder(worlds["hf"]), _load_folder(str(worlds["tmp"] / name / "gathered"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k].to(getattr(torch, dtype)), got[k]), \
            f"{k} differs after the reshard"
