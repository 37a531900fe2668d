"""Hybrid engine weight sync: the actor's weights resharded from a TP x PP training layout into a
TP' rollout model equal a fresh ``from_pretrained`` of the actor's ``save_pretrained``, bit for
bit, twice in a row (buffers reused), with peak extra memory of one bucket + a tensor."""

import pytest

from parallel_models.testing import run_distributed
from tests import weight_sync_checks


@pytest.mark.parametrize("tp,pp,rollout_tp,world", [(1, 2, 1, 2), (2, 2, 2, 4), (2, 2, 1, 4),
                                                     (1, 1, 2, 2)])
def test_sync_bit_identical_to_fresh_load(tmp_path, hf_models, tp, pp, rollout_tp, world):
    bucket = 32 * 1024  # several buckets in the tiny model
    results = run_distributed(weight_sync_checks.sync_matches_fresh_load, world,
                              hf_models[("llama", "causal_lm")], str(tmp_path), tp, pp,
                              rollout_tp, bucket, timeout=240)
    for rank, r in enumerate(results):
        assert not r["mismatch"], f"rank {rank}: {r['mismatch'][:5]}"
        assert r["buckets"] > 3
        assert r["buffers_reused"]
        largest = r["largest_tensor_bytes"]
        # first sync: its kept buffers (one bucket + the gather scratch) and the temporaries of
        # one tensor; later syncs: the temporaries only. A whole-model gather would not fit.
        assert r["peaks"][0] <= r["buffer_bytes"] + 2 * largest, (rank, r)
        assert r["peaks"][1] <= 2 * largest, (rank, r)
        assert r["peaks"][0] < r["model_bytes"], (rank, r)
