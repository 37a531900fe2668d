"""``bench/async_grpo.py`` (sync colocated vs async, issue 35) end to end at its tiny shape on the
CPU, ``--preset long-tail`` (per-prompt response caps, one long prompt per step, async at k = 3
with partial rollouts): both modes run in one invocation and print one JSON line each with the
throughput over the steps after the warm-up and the median of each trainer timing (the GPU run
must not be its first run).

The bench's ``main`` runs in the test's process; its two ``parallel-models-ppo`` launches
(``torchrun --nproc-per-node 2`` for sync, one process for async) run as processes forked from
the preloaded forkserver (``parallel_models.console_processes.start_main``, torchrun's environment per
rank) instead of fresh interpreters; the async run starts its own rollout server as the bench
does on the GPU. The launcher itself is tested where it is the subject (tests/test_cli.py,
tests/distributed/test_multinode.py). (Measured at load 5-10 on 2 cores: 13-17 s, against
35-64 s for 3 steps in fresh interpreters.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from parallel_models.console_processes import MainRanks

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "async_grpo.py")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK")


class _ForkedLaunches:
    """The ``subprocess`` module of the bench with ``Popen`` of ``python [-m
    torch.distributed.run --nproc-per-node N --master-port P] -m module args`` replaced by
    forked processes (one per rank, one process group led by rank 0, so the bench's
    ``os.killpg`` reaches them all); their output goes to this process's stderr at the end."""

    def __init__(self):
        self.launched = []

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def Popen(self, cmd, *, env=None, **_):  # noqa: N802 (subprocess's name)
        from parallel_models.console_processes import start_main

        cmd = [str(c) for c in cmd]
        nproc, master_port, rest = 1, None, cmd[1:]
        if rest[:2] == ["-m", "torch.distributed.run"]:
            opts, rest = rest[2:rest.index("-m", 2)], rest[rest.index("-m", 2):]
            nproc = int(opts[opts.index("--nproc-per-node") + 1])
            master_port = opts[opts.index("--master-port") + 1]
        assert rest[0] == "-m", cmd
        target, argv = f"{rest[1]}:main", rest[2:]
        env = {k: v for k, v in (env or os.environ).items() if k not in _TORCHRUN_VARS}
        if master_port is None:
            ranks = [start_main(target, argv, env, new_session=True)]
        else:
            ranks = []
            for rank in range(nproc):
                ranks.append(start_main(target, argv, dict(
                    env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=master_port), process_group=ranks[0].pid if ranks else 0))
        self.launched.append(ranks)
        return MainRanks(ranks)

    def echo_and_close(self) -> None:
        for ranks in self.launched:
            for r in ranks:
                sys.stderr.write(r.stderr[-3000:])
                r.close()


def test_tiny_sync_and_async_report_throughput(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(BENCH)))
    spec = importlib.util.spec_from_file_location("async_grpo_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    launches = _ForkedLaunches()
    monkeypatch.setattr(bench, "subprocess", launches)
    try:
        bench.main(["--mode", "both", "--preset", "long-tail", "--shape", "tiny", "--steps",
                    "2", "--warmup", "1", "--prompts", "4", "--n", "2", "--prompt-len", "8",
                    "--max-new", "8", "--long-prompts", "1", "--long-min", "7",
                    "--response-median", "3", "--response-min", "1", "--mini-batch", "8",
                    "--micro-tokens", "64", "--timeout", "300", "--root", str(tmp_path)])
    finally:
        launches.echo_and_close()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("{")]
    assert [r["mode"] for r in lines] == ["sync", "async"]
    assert [len(ranks) for ranks in launches.launched] == [2, 1]  # torchrun's 2 ranks, 1 trainer
    for r in lines:
        assert r["returncode"] == 0
        assert r["steps_logged"] == 2 and r["steps_measured"] == 1
        assert len(r["samples_per_s"]["values"]) == 1 and r["samples_per_s"]["median"] > 0
        # one measured step: its rate is the rate over the steps' summed time
        assert abs(r["samples_per_s"]["overall"] - r["samples_per_s"]["median"]) < 1e-9
        assert abs(r["tokens_per_s_per_gpu"]["overall"] - r["tokens_per_s_per_gpu"]["min"]) \
            < 1e-6 * r["tokens_per_s_per_gpu"]["min"]
        assert r["tokens_per_s_per_gpu"]["min"] > 0
        assert r["timing"]["gen_s"] > 0 and r["timing"]["train_actor_s"] > 0
    caps = [json.loads(line)["budget"] for line in open(tmp_path / "prompts.jsonl")]
    assert len(caps) == 8 and max(caps) >= 7  # a long prompt in each step
    # ignore_eos: every response as long as its prompt's cap, the same in both modes
    means = [sum(caps[4 * s:4 * s + 4]) / 4 for s in range(2)]
    for r in lines:
        assert r["response_length_mean"]["values"] == [means[1]]
    sync, run = lines
    assert run["max_staleness"] == 3 and run["partial"]  # the preset's
    assert run["staleness_max"]["max"] <= 3 and run["timing"]["sync_s"] > 0
    # the one-process trainer's push in the background: its snapshot, the send of the one before
    assert {"weight_snapshot_s", "weight_push_s"} <= run["timing"].keys()
    assert "sync_s" not in sync["timing"] and "staleness_mean" in run["async"]
