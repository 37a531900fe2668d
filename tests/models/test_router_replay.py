"""Router replay (MoE, ``llama/layers/router_replay.py``) against the rollout engine's own
record, fp32 on gloo, at TP=1, EP=2 and TP=2 (sequence parallel, which MoE at TP>1 forces):

- R3: the old-log-prob forward replaying the rollout's routes reproduces the rollout's
  log-probs (max abs <= 1e-5) and uses exactly its routes, in one or several microbatches;
- near-tie routers (tests/helpers/router_replay_checks.py): without replay the training forward routes
  some tokens differently from the rollout (which groups the same tokens otherwise: a packed
  prefill, then one token per row and step) and its log-probs are off by ~1e-2; R3 removes
  both;
- PP=2: each stage replays its own MoE layers' routes (the same rollout batches);
- replaying routes that agree changes nothing: logits and gradients equal (<= 1e-6), and the
  router still gets gradients.
"""

import pytest

from parallel_models.testing import run_distributed, run_distributed_jobs
from tests.helpers import router_replay_checks as checks

LOGP_TOL = 1e-5
IDENTITY_TOL = 1e-6
SETTINGS = {"tp1": (1, 1), "ep2": (1, 2), "tp2": (2, 1)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return checks.save_models(str(tmp_path_factory.mktemp("router_replay")))


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    saved = str(tmp_path_factory.mktemp("rollouts"))  # tp1 writes its rollouts, pp2 reads them
    out = {"tp1": run_distributed(checks.replay_against_rollout, 1, models, 1, 1, saved,
                                  timeout=300)}
    two = [name for name, (tp, ep) in SETTINGS.items() if tp * ep == 2]  # one 2-rank world
    jobs = [(checks.replay_against_rollout, (models, *SETTINGS[name], None)) for name in two]
    jobs.append((checks.replay_through_pipeline, (models, saved)))
    out.update(zip([*two, "pp2"], run_distributed_jobs(jobs, 2, timeout=600)))
    return out


def test_r3_through_the_pipeline_stages(results):
    for rank, res in enumerate(results["pp2"]):
        for model, r in res.items():
            assert r["r3_diff"] <= LOGP_TOL, (rank, model, r)
            differing, compared = r["r3_routes"]
            assert compared > 100 and differing == 0, (rank, model, r)
            assert r["stage_layers"] == [rank], r  # each stage records its own MoE layer only
        assert res["near_tie"]["off_mismatch"] > 0.01 and res["near_tie"]["off_diff"] > 1e-3


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_r3_reproduces_rollout_log_probs_and_routes(results, setting):
    for rank, res in enumerate(results[setting]):
        for model, r in res.items():
            assert r["routes_dtype"] == "torch.uint8" and r["routes_shape"][2:] == (2, 2)
            for budget in (40, 4096):
                assert r[f"r3_{budget}_diff"] <= LOGP_TOL, (setting, rank, model, budget, r)
                assert r[f"r3_{budget}_routes_compared"] > 100
                assert r[f"r3_{budget}_routes_differ"] == 0, (setting, rank, model, budget, r)
        plain = res["plain"]
        assert plain["off_4096_diff"] <= LOGP_TOL and plain["off_4096_mismatch"] == 0.0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_near_tie_routes_differ_without_replay(results, setting):
    tie = [res["near_tie"] for res in results[setting]]
    # the rollout (prompts packed in one prefill, then one token per row and step against the
    # KV cache) and the training forward (whole sequences packed) group the same tokens
    # differently: every rank routes some of them differently, with log-probs off by ~1e-2
    # (R3 brings both back: test_r3_reproduces_rollout_log_probs_and_routes)
    for budget in (40, 4096):
        assert all(r[f"off_{budget}_mismatch"] > 0.01 for r in tie), tie
        assert all(r[f"off_{budget}_diff"] > 100 * LOGP_TOL for r in tie), tie


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_replay_of_agreeing_routes_changes_nothing(results, setting):
    for rank, res in enumerate(results[setting]):
        r = res["plain"]["identity"]
        assert r["compared"] > 0 and r["differing"] == 0, r
        assert r["logits"] <= IDENTITY_TOL and r["grads"] <= IDENTITY_TOL, (setting, rank, r)
        assert r["same_grad_keys"] and r["router_grads"] > 0, r
