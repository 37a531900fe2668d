"""Multi-node launch: two ``torchrun`` processes on this machine act as two nodes (one rank each,
c10d rendezvous) and run the default PPO job at TP=2 across them. The run must equal the same job
launched as one node with two ranks (same seed: same metrics), so the rendezvous, the rank
numbering and the groups spanning "nodes" are what a real two-node launch gets. (The one-node
run's two ranks are forked with torchrun's environment: the torchrun launch is the one under
test, and the fresh interpreters of a second one cost seconds of CPU each.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from parallel_models.testing import free_port
from tests.helpers.ppo_runs import ENV, run_metrics, run_ppo_ranks

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
JOB = ["-m", "parallel_models.rl.train", "parallel.tensor_parallel_size=2",
       "trainer.total_steps=2", "trainer.save_every=0", "trainer.loggers=[jsonl]"]


def _wait(procs, timeout=300):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}"


def test_two_node_launch_equals_one_node(tmp_path):
    port = free_port()
    two_nodes = str(tmp_path / "two_nodes")
    procs = [subprocess.Popen(
        [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pm-test",
         *JOB, f"trainer.output_dir={two_nodes}"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    _wait(procs)
    one_node = str(tmp_path / "one_node")
    run_ppo_ranks([*JOB[2:], f"trainer.output_dir={one_node}"], 2)
    a, b = run_metrics(two_nodes), run_metrics(one_node)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "actor/pg_loss", "critic/vf_loss", "response_length/mean"):
            assert ra[key] == rb[key] or abs(ra[key] - rb[key]) <= 1e-6 * max(1.0, abs(rb[key])), \
                (key, ra[key], rb[key])
