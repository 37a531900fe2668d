"""``parallel-models-ppo`` keeps its promises on bad input (issue 31 items 4 and 5): every user
error is one ``parallel-models-ppo: error: ...`` line and exit code 2 (a traceback only with
``--debug``), and the prompt files, the model path and the reward function are checked before
anything is written into ``trainer.output_dir``."""

from __future__ import annotations

import os

import pytest

from tests.helpers.ppo_runs import ENV, run_ppo

PROG = "parallel-models-ppo"


def _one_line_error(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), proc.stderr[-3000:]
    return lines[0]


def _bad_inputs(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "one"}\n{"prompt": "two"\n')
    other_key = tmp_path / "other_key.jsonl"
    other_key.write_text('{"question": "one"}\n{"question": "two"}\n')
    return {
        "broken JSONL line": ([f"data.path={broken}"], f"{broken}:2: invalid JSON"),
        "wrong data.prompt_key": ([f"data.path={other_key}"], "data.prompt_key"),
        "prompt key set right, file still checked": (
            [f"data.path={other_key}", "data.prompt_key=text"], "'question'"),
        "hub model that cannot be fetched": (
            ["model.path=no-such-org/no-such-model"],
            "model.path: 'no-such-org/no-such-model' is not a local folder and could not be "
            "fetched"),
        "missing reward function file": ([f"reward.function={tmp_path}/nope.py:score"],
                                         "reward.function"),
    }


CASES = ("broken JSONL line", "wrong data.prompt_key", "prompt key set right, file still checked",
         "hub model that cannot be fetched", "missing reward function file")


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, case):
    args, names = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    env = {**ENV, "HF_HUB_OFFLINE": "1"}  # no network in tests: the cache is all there is
    proc = run_ppo([*args, f"trainer.output_dir={out}", "trainer.total_steps=1"], check=False,
                   env=env, timeout=120)
    line = _one_line_error(proc)
    assert names in line, line
    assert not out.exists(), sorted(p.name for p in out.iterdir())  # nothing written


def test_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "broken.jsonl"
    bad.write_text("{oops\n")
    args = [f"data.path={bad}", f"trainer.output_dir={tmp_path / 'out'}"]
    proc = run_ppo([*args, "--debug"], check=False, timeout=120)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr
    proc = run_ppo(args, check=False, timeout=120, env={**ENV, "PARALLEL_MODELS_DEBUG": "1"})
    assert "Traceback" in proc.stderr


def test_resume_with_other_data_is_a_user_error():
    """The prompt loader of a checkpoint refuses other data as a ConfigError (one line, exit 2
    in the CLI), naming the settings to resume with."""
    from parallel_models.errors import ConfigError
    from parallel_models.rl.data.prompts import PromptLoader
    from parallel_models.rl.train import is_user_error

    saved = PromptLoader([{"prompt": str(i)} for i in range(32)], batch_size=4).state_dict()
    loader = PromptLoader([{"prompt": str(i)} for i in range(8)], batch_size=4)
    with pytest.raises(ConfigError, match="dataset_size=32.*dataset_size=8.*data.path") as err:
        loader.load_state_dict(saved)
    assert is_user_error(err.value)
    assert not is_user_error(RuntimeError("a bug"))


def test_model_path_problems(tmp_path, monkeypatch):
    """Each model key: a local folder needs its config.json (a tokenizer folder: tokenizer
    files), a file or a missing absolute path is named, a hub id is asked once (offline here:
    the cache only)."""
    from parallel_models.rl.preflight import model_path_problem
    from parallel_models.tokenizer import build_builtin_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "file.txt").write_text("x")
    tok = tmp_path / "tok"
    build_builtin_tokenizer().save_pretrained(tok)
    assert model_path_problem("model.path", None) is None
    assert model_path_problem("model.path", "builtin-moe") is None
    assert "holds no config.json" in model_path_problem("critic.path", str(empty))
    assert model_path_problem("model.tokenizer", str(tok), "tokenizer") is None
    assert "holds no tokenizer files" in model_path_problem("model.tokenizer", str(empty),
                                                             "tokenizer")
    assert "is a file" in model_path_problem("model.path", str(tmp_path / "file.txt"))
    assert "no such folder" in model_path_problem("model.path", str(tmp_path / "nope"))
    line = model_path_problem("reward.model_path", "no-such-org/no-such-model")
    assert line.startswith("reward.model_path: 'no-such-org/no-such-model' is not a local")
    assert "HF_HUB_OFFLINE" in line and "\n" not in line


def test_torchrun_reports_an_input_error_once(tmp_path):
    """Under torchrun every rank finds the same bad input; rank 0 says it, every rank exits 2.
    The two ranks run ``main`` with the environment torchrun gives them, forked from the
    preloaded forkserver (``start_main_ranks``; the launcher itself: tests/test_quiet_runs.py,
    tests/distributed/test_multinode.py), and each rank's own exit code is read."""
    from parallel_models.console_processes import start_main_ranks
    from tests.helpers.ppo_runs import MAIN

    bad = tmp_path / "broken.jsonl"
    bad.write_text("{oops\n")
    run = start_main_ranks(MAIN, [f"data.path={bad}", f"trainer.output_dir={tmp_path / 'out'}"],
                           2, ENV)
    try:
        codes = [rank.wait(300) for rank in run.ranks]  # each to its own end (no rank killed)
        stderr = run.stderr
    finally:
        run.kill()
        run.close()
    assert codes == [2, 2], (codes, stderr[-3000:])
    errors = [line for line in stderr.splitlines() if line.startswith(f"{PROG}: error: ")]
    assert len(errors) == 1 and f"{bad}:1: invalid JSON" in errors[0], stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_under_torchrun_other_ranks_leave_after_rank0(tmp_path):
    """torchrun stops every rank as soon as one fails, so a rank other than 0 that leaves with
    the shared input error first could have rank 0 stopped before it prints the report. Under
    torchrun (``TORCHELASTIC_RUN_ID`` set) rank 1 finds the error and stays until it is
    stopped, even before rank 0 has started; rank 0 then prints the one report and exits 2, and
    torchrun's SIGTERM ends rank 1."""
    import signal
    import time

    from parallel_models.distributed import free_port
    from parallel_models.console_processes import TORCHRUN_VARS, start_main
    from tests.helpers.ppo_runs import MAIN

    bad = tmp_path / "broken.jsonl"
    bad.write_text("{oops\n")
    argv = [f"data.path={bad}", f"trainer.output_dir={tmp_path / 'out'}"]
    marker = tmp_path / "rank1_waits"
    env = {k: v for k, v in ENV.items() if k not in TORCHRUN_VARS}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", GROUP_RANK="0", TORCHELASTIC_RUN_ID="test",
               PM_TEST_WAIT_MARKER=str(marker))
    rank1 = start_main("tests.helpers.torchrun_rank:main", argv,
                       dict(env, RANK="1", LOCAL_RANK="1"))
    rank0 = None
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and rank1.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polls rank 1's progress (no fixed wait)
        assert marker.exists() and rank1.poll() is None, (rank1.poll(), rank1.stderr[-3000:])
        rank0 = start_main(MAIN, argv, dict(env, RANK="0", LOCAL_RANK="0"))
        assert rank0.wait(300) == 2, rank0.stderr[-3000:]
        assert f"{bad}:1: invalid JSON" in rank0.stderr
        assert rank1.poll() is None, rank1.stderr[-3000:]  # still waiting to be stopped
        os.kill(rank1.pid, signal.SIGTERM)  # what torchrun does next
        assert rank1.wait(60) == -signal.SIGTERM
        assert f"{PROG}: error: " not in rank1.stderr  # rank 0 alone reports it
    finally:
        for r in (rank0, rank1):
            if r is not None:
                r.kill()
                r.close()
