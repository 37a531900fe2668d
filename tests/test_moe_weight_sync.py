"""Hybrid engine weight sync of MoE models (``rollout/weight_sync.py``): experts gathered over EP
and the pipeline stages, re-split for the rollout TP'; the rollout model equals a fresh
``from_pretrained`` of the actor's ``save_pretrained``, bit for bit, twice in a row."""

import pytest

from parallel_models.testing import run_distributed, save_tiny_hf_model
from tests import hybrid_checks


@pytest.mark.parametrize("family,tp,pp,ep,rollout_tps", [
    ("qwen3_moe", 1, 1, 2, [1, 2]),
    ("qwen2_moe", 1, 2, 1, [1]),
], ids=["qwen3moe-ep2", "qwen2moe-pp2"])
def test_moe_sync_bit_identical_to_fresh_load(tmp_path, family, tp, pp, ep, rollout_tps):
    model = save_tiny_hf_model(str(tmp_path / family), family, seed=1,
                               num_hidden_layers=4)  # 2 per pipeline stage
    results = run_distributed(hybrid_checks.sync_matches_fresh_load, 2, model, str(tmp_path),
                              tp, pp, rollout_tps, 16 * 1024, 1, ep, timeout=300)
    for rank, by_tp in enumerate(results):
        for rollout_tp, r in by_tp.items():
            where = f"rank {rank}, {family} TP={tp} x PP={pp} x EP={ep} -> TP'={rollout_tp}"
            assert not r["mismatch"], f"{where}: {r['mismatch'][:5]}"
            assert r["buckets"] > 3 and r["buffers_reused"], where
