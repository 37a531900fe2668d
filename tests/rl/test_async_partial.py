"""Partial rollouts (issue 35 step 3): with the server's ``--partial-rollouts`` a weight update
lands between two decode steps of the continuous engine and the requests in flight go on under
the new weights. Every token records the version that drew it; the samples carry both versions,
and each token's behaviour log-prob equals transformers' recompute under the weights of its own
version over the sample's prefix (the KV cache of the prefix is recomputed at the update)."""

from parallel_models.testing import run_distributed
from tests.helpers import partial_rollout_checks as checks
from tests.helpers import server_checks


def test_update_mid_request_every_token_under_its_own_version(tmp_path):
    first = server_checks.tiny_builtin_model(str(tmp_path / "v1"), seed=1)
    second = server_checks.tiny_builtin_model(str(tmp_path / "v2"), seed=2)
    res = run_distributed(checks.partial_update_run, 1, first, second, timeout=300)[0]
    assert res["new"] == res["old"] + 1
    assert len(res["samples"]) == 2 * len(checks.PROMPTS)
    for s in res["samples"]:
        assert len(s["tokens"]) == checks.MAX_NEW
        # before the update: the prefill's draw and one decode per engine step, old weights
        before = checks.STEPS_BEFORE + 1
        assert s["versions"] == [res["old"]] * before + [res["new"]] * (checks.MAX_NEW - before)
        assert s["tokens"] == s["greedy"]  # each one the greedy choice of its version
        for got, want in zip(s["log_probs"], s["recomputed"]):
            assert abs(got - want) <= 1e-4 + 1e-4 * abs(want), (s["log_probs"], s["recomputed"])
