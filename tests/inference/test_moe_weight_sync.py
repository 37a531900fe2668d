"""Hybrid engine weight sync of MoE models (``rollout/weight_sync.py``): experts gathered over EP
and the pipeline stages, re-split for the rollout TP'; the rollout model equals a fresh
``from_pretrained`` of the actor's ``save_pretrained``, bit for bit, twice in a row."""

import pytest

from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model
from tests.helpers import hybrid_checks


CASES = {"qwen3moe-ep2": ("qwen3_moe", 1, 1, 2, [1, 2]),
         "qwen2moe-pp2": ("qwen2_moe", 1, 2, 1, [1])}


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """Both cases on 2 ranks in one spawned world."""
    jobs = []
    for name, (family, tp, pp, ep, rollout_tps) in CASES.items():
        tmp = tmp_path_factory.mktemp(name)
        model = save_tiny_hf_model(str(tmp / family), family, seed=1,
                                   num_hidden_layers=4)  # 2 per pipeline stage
        jobs.append((hybrid_checks.sync_matches_fresh_load, (model, str(tmp), tp, pp, rollout_tps,
                                                             16 * 1024, 1, ep)))
    return dict(zip(CASES, run_distributed_jobs(jobs, 2, timeout=600)))


@pytest.mark.parametrize("name", list(CASES))
def test_moe_sync_bit_identical_to_fresh_load(synced, name):
    family, tp, pp, ep, _ = CASES[name]
    results = synced[name]
    for rank, by_tp in enumerate(results):
        for rollout_tp, r in by_tp.items():
            where = f"rank {rank}, {family} TP={tp} x PP={pp} x EP={ep} -> TP'={rollout_tp}"
            assert not r["mismatch"], f"{where}: {r['mismatch'][:5]}"
            assert r["buckets"] > 3 and r["buffers_reused"], where
