"""Context parallelism (``parallel.context_parallel_size``) equals CP = 1: a packed batch of
uneven sequences (some shorter than 2 x CP) through the same checkpoint at CP = 1 and CP = 2 in
the same gloo ranks (fp32); logits (full vocab) or values, the next-token log-probs and entropy
(computed on the CP shards, and from the gathered logits), the loss, and every weight's gradient
(this rank's TP shard) agree to rel <= 1e-5. CP = 2 alone (2 ranks) and CP = 2 x TP = 2 (4 ranks,
with and without sequence parallel); the LM head's vocab-parallel log-prob path and the value head
(critic / reward model) both."""

import pytest

from parallel_models.testing import run_named_jobs
from tests.helpers import context_parallel_checks
from tests.helpers.vocab_parallel_checks import max_rel_error as _rel

# (name, family, head, TP, SP, world)
CASES = [("cp2-llama-lm", "llama", "causal_lm", 1, False, 2),
         ("cp2-qwen2-value", "qwen2", "value", 1, False, 2),
         ("cp2tp2sp-llama-lm", "llama", "causal_lm", 2, True, 4),
         ("cp2tp2-qwen2-lm", "qwen2", "causal_lm", 2, False, 4)]


@pytest.fixture(scope="module")
def results(hf_models):
    named = [(name, world, (context_parallel_checks.parity,
                            (hf_models[(family, head)], head, tp, 2, sp)))
             for name, family, head, tp, sp, world in CASES]
    named.append(("bad", 2, (context_parallel_checks.bad_world, (4,))))
    return run_named_jobs(named, timeout=800)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_context_parallel_equals_cp1(results, case):
    name, _, _, tp, sp, world = case
    ranks = results[name]
    assert len(ranks) == world
    for rank, r in enumerate(ranks):
        ref, got = r["reference"], r["got"]
        assert "CP=2" in got["layout"] and "CP=" not in ref["layout"], (got["layout"], ref["layout"])
        where = f"{name} rank {rank}"
        assert _rel(got["output"], ref["output"]) <= 1e-5, where
        assert _rel(got["loss"], ref["loss"]) <= 1e-5, where
        for key in ("logp", "entropy", "logp_gathered"):  # the LM cases' per-token paths
            if key in ref:
                assert _rel(got[key], ref[key]) <= 1e-5, (where, key)
        if "logp" in ref:
            assert _rel(got["logp_gathered"], got["logp"]) <= 1e-5, where
        assert set(got["grads"]) == set(ref["grads"]), where
        for key, want in ref["grads"].items():
            assert want.abs().max() > 0, (where, key)  # every weight takes part in the loss
            assert _rel(got["grads"][key], want) <= 1e-5, (where, key)


def test_world_not_divisible_is_named(results):
    for message in results["bad"]:
        assert "context_parallel_size (4)" in message and "world size 2" in message, message


def test_expert_parallel_with_context_parallel_logits(tmp_path):
    """EP = 2 x CP = 2 on 4 ranks: megatron-core's MoE layer dispatches each CP rank's own
    tokens; the logits equal EP = 2 at CP = 1 (forward)."""
    from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model

    path = save_tiny_hf_model(str(tmp_path / "moe"), "qwen3_moe", seed=1, router_scale=25.0)
    ref, got = run_distributed_jobs([(context_parallel_checks.moe_logits, (path, 2, 1)),
                                     (context_parallel_checks.moe_logits, (path, 2, 2))], 4,
                                    timeout=600)
    for r, g in zip(ref, got):
        assert _rel(g, r) <= 1e-5


def test_expert_parallel_with_context_parallel_gradients(tmp_path):
    """EP = 2 x CP = 2 (4 ranks; the EP group is the CP group, DP = 2) through
    ``pipeline.forward_backward``: every gradient equals the 1-rank run's (rel <= 1e-5), the
    routed experts' included (each EP rank's experts already sum both CP halves' tokens; the
    dense weights are summed over CP). Both DP replicas see the same batch, so the token count
    doubles and the gradients halve (see the next test)."""
    import re

    from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model

    path = save_tiny_hf_model(str(tmp_path / "moe"), "qwen3_moe", seed=1, router_scale=25.0)
    (ref,) = run_distributed_jobs([(context_parallel_checks.schedule_grads, (path, 1, 1))], 1,
                                  timeout=600)
    (got,) = run_distributed_jobs([(context_parallel_checks.schedule_grads,
                                    (path, 1, 2, "none", 2))], 4, timeout=600)
    ref, experts_seen = ref[0], set()
    for rank, grads in enumerate(got):
        ep_rank = rank % 2  # megatron's order: EP innermost after TP, as CP
        for key, g in grads.items():
            m = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", key)
            want_key = key
            if m:  # local expert i of EP rank r is global expert r * (4 / 2) + i
                want_key = f"{m.group(1)}{ep_rank * 2 + int(m.group(2))}{m.group(3)}"
                experts_seen.add(want_key)
            assert _rel(g, 0.5 * ref[want_key]) <= 1e-5, (rank, key)
    assert experts_seen == {k for k in ref if ".local_experts." in k}


def test_schedule_reduces_gradients_over_context_parallel(hf_models):
    """``pipeline.forward_backward`` without DDP sums the CP ranks' gradients itself: CP = 2 x
    TP = 2 equals CP = 1 x TP = 2 (4 ranks, two microbatches)."""
    from parallel_models.testing import run_distributed_jobs

    path = hf_models[("llama", "causal_lm")]
    ref, got = run_distributed_jobs([(context_parallel_checks.schedule_grads, (path, 2, 1)),
                                     (context_parallel_checks.schedule_grads, (path, 2, 2))], 4,
                                    timeout=600)
    for r, g in zip(ref, got):
        for key in r:
            # the plain finalize divides by the tokens of all DP ranks but leaves each DP
            # rank its own data's gradient: CP = 1 runs at DP = 2 here (the same batch on both
            # replicas), CP = 2 at DP = 1
            assert _rel(g[key], 2 * r[key]) <= 1e-5, key
