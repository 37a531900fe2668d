"""MoE families (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral) on megatron-core's
MoE layer against transformers on the same weights: fp32 logits/values max abs <= 1e-4, padded
(left and right) and RmPad, at TP=1, EP=2, TP=2 (+SP), TP=2 x EP=2 and PP=2 (a dense layer among
the MoE layers; odd vocab sizes, so never divisible by TP); gradients at EP=2 (rel <= 1e-4,
router and experts included). Routing is made tie-free by wide router margins, checked here."""

import pytest

from parallel_models.testing import run_named_jobs, save_tiny_hf_model
from tests.helpers import moe_checkpoint_checks
from tests.helpers import moe_checks

FWD_TOL = 1e-4
GRAD_TOL = 1e-4
MIN_MARGIN = 1e-3  # smallest k-th vs (k+1)-th router logit gap: far above float rounding
# name -> (tp, ep, sp, heads)
SAVE_LAYOUTS = [(2, 2, 1), (1, 2, 2)]  # (tp, ep, pp)
SETTINGS = {"tp1": (1, 1, False, ("causal_lm", "value")),
            "ep2": (1, 2, False, ("causal_lm",)),
            "tp2_sp": (2, 1, True, ("causal_lm",)),
            "tp2_ep2": (2, 2, True, ("causal_lm",))}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {(family, head): moe_checks.save_moe_model(str(root / f"{family}_{head}"), family, head)
            for family in moe_checks.MOE_FAMILIES for head in ("causal_lm", "value")}


def _causal(moe_models):
    return {k: v for k, v in moe_models.items() if k[1] == "causal_lm"}


@pytest.fixture(scope="module")
def worlds(moe_models, tmp_path_factory):
    """Every distributed check of this file, one spawned world per world size (the spawn and
    the imports are paid once per size); name -> per-rank results."""
    causal, tmp = _causal(moe_models), tmp_path_factory.mktemp("moe_worlds")
    named = [(("forward", name), tp * ep, moe_checks.check_moe_forward,
              ({key: path for key, path in moe_models.items() if key[1] in heads}, tp, ep, sp))
             for name, (tp, ep, sp, heads) in SETTINGS.items()]
    named.append((("gradients_ep2",), 2, moe_checks.check_moe_gradients, (causal, 1, 2)))
    named.append((("pp2",), 2, moe_checks.check_moe_pp_forward, (causal, 1, 2, 1)))
    for tp, ep, pp in SAVE_LAYOUTS:
        folders = {k: v for k, v in causal.items() if pp == 1 or k[0] == "qwen3_moe"}  # PP: the
        named.append((("save", tp, ep, pp), tp * ep * pp,                         # family with
                      moe_checkpoint_checks.check_moe_save_round_trip,            # a dense layer
                      (folders, str(tmp / f"save_{tp}_{ep}_{pp}"), tp, ep, pp)))
    named.append((("aux_loss",), 2, moe_checks.check_moe_aux_loss, (causal, 2, 1)))
    trips = moe_checkpoint_checks.convert_round_trip(causal, str(tmp / "convert"))
    cases = {family: (causal[(family, "causal_lm")], r["mcore"]) for family, r in trips.items()}
    named.append((("mcore_loads",), 4, moe_checkpoint_checks.check_mcore_loads, (cases, 2, 2)))
    named.append((("save_mcore",), 4, moe_checkpoint_checks.check_save_mcore_round_trip,
                  (causal, str(tmp / "save_mcore"), 2, 2)))
    named.append((("train_ep2",), 2, moe_checks.check_moe_train_steps,
                  (moe_models[("qwen2_moe", "causal_lm")], 2)))
    named.append((("grouped_forward",), 4, moe_checks.check_moe_forward, (causal, 2, 2, True, True)))
    named.append((("grouped_gradients",), 2, moe_checks.check_moe_gradients, (causal, 1, 2, True)))
    bad = {"dense_with_ep": save_tiny_hf_model(str(tmp / "dense"), "qwen2"),
           "experts_not_divisible": moe_checks.save_moe_model(str(tmp / "three"), "qwen3_moe",
                                                              num_experts=3),
           "top1_normalized": moe_checks.save_moe_model(str(tmp / "top1"), "mixtral",
                                                        num_experts_per_tok=1),
           "aux_without_recording": moe_models[("qwen3_moe", "causal_lm")]}
    named.append((("bad_settings",), 2, moe_checks.check_bad_moe_settings, (bad, 1, 2)))
    named.append((("bad_init",), 2, moe_checks.check_bad_moe_settings, ({}, 2, 2)))
    out = run_named_jobs([(name, w, (fn, args)) for name, w, fn, args in named], timeout=1200)
    return {"convert": trips, **out}


@pytest.fixture(scope="module")
def forward_results(worlds):
    return {name: worlds[("forward", name)] for name in SETTINGS}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", moe_checks.MOE_FAMILIES)
def test_moe_forward_matches_transformers(forward_results, setting, family):
    heads = SETTINGS[setting][3]
    for rank, res in enumerate(forward_results[setting]):
        keys = [k for k in res["errors"] if k.startswith(family + "-")]
        assert len(keys) == 4 * len(heads), keys  # padded/rmpad x left/right per head
        for key in keys:
            err = res["errors"][key]
            assert err <= FWD_TOL, f"{setting} rank {rank} {key}: max abs error {err:.3e}"
        for key, margin in res["margins"].items():
            assert margin >= MIN_MARGIN, f"{key}: router top-k margin {margin:.2e} (near tie)"


def test_moe_gradients_match_transformers_at_ep2(worlds):
    for rank, res in enumerate(worlds[("gradients_ep2",)]):
        for family, r in res.items():
            assert r["checked"] > 0
            assert r["worst_rel"] <= GRAD_TOL, (f"rank {rank} {family}: {r['worst']} grad rel "
                                                f"error {r['worst_rel']:.3e}")


def test_moe_pipeline_forward_matches_transformers(worlds):
    stage_layers = [set(), set()]
    for rank, res in enumerate(worlds[("pp2",)]):
        for key, err in res.items():
            if key.endswith("-layers"):
                if key.startswith("qwen3_moe"):
                    stage_layers[rank].update(err)
                continue
            assert err <= FWD_TOL, f"PP=2 rank {rank} {key}: max abs error {err:.3e}"
    # tiny Qwen3-MoE: layers 0 and 2 MoE, layer 1 dense, split [2, 1] over the stages
    assert stage_layers == [{0, 1}, {2}]


@pytest.mark.parametrize("tp,ep,pp", SAVE_LAYOUTS)
def test_moe_save_pretrained_round_trip_is_bit_exact(worlds, tp, ep, pp):
    for family, r in worlds[("save", tp, ep, pp)][0].items():
        assert r["count"] > 0
        assert r["differ"] == [] and r["missing"] == [] and r["extra"] == [], (family, r)


def test_moe_load_balancing_loss_matches_transformers(worlds):
    """At TP=2 (+SP: each rank routes half the tokens): value and router-weight gradients of
    the load-balancing loss vs transformers' aux_loss (output_router_logits=True)."""
    for rank, res in enumerate(worlds[("aux_loss",)]):
        for family, r in res.items():
            assert abs(r["ours"] - r["hf"]) <= 1e-5 * abs(r["hf"]), (rank, family, r)
            assert r["grad_rel"] <= GRAD_TOL, (rank, family, r)


def test_moe_hf2mcore_mcore2hf_round_trip_and_megatron_loads(worlds):
    """HF -> hf2mcore -> mcore2hf bit-exact; megatron-core's own GPTModel (MoE block spec, local)
    at TP=2 x EP=2 loads the hf2mcore output and matches transformers, and so does ours."""
    for family, r in worlds["convert"].items():
        assert r["count"] > 0
        assert r["differ"] == [] and r["missing"] == [] and r["extra"] == [], (family, r)
    for rank, res in enumerate(worlds[("mcore_loads",)]):
        for family, r in res.items():
            assert r["megatron"] <= FWD_TOL, (rank, family, r)
            assert r["ours"] <= FWD_TOL, (rank, family, r)


def test_moe_save_mcore_round_trip_is_bit_exact(worlds):
    for family, r in worlds[("save_mcore",)][0].items():
        assert r["count"] > 0
        assert r["differ"] == [] and r["missing"] == [] and r["extra"] == [], (family, r)


def test_bad_moe_settings_are_named(worlds):
    res = worlds[("bad_settings",)][0]
    assert "expert_model_parallel_size=2" in res["dense_with_ep"] and "no MoE" in res["dense_with_ep"]
    assert "num_experts (3) is not divisible by expert_model_parallel_size (2)" in \
        res["experts_not_divisible"]
    assert "num_experts_per_tok=1 with norm_topk_prob" in res["top1_normalized"]
    assert "record_router_logits" in res["aux_without_recording"]
    init = worlds[("bad_init",)][0]
    assert "expert_model_parallel_size (2)" in init["init"] and "world size 2" in init["init"]


def test_moe_train_steps_at_ep2_match_hf_adamw(worlds):
    """Two Adam steps through megatron-core's DDP and optimizer at EP=2 (expert gradients over
    the expert-data-parallel group, grad norm over the expert-parallel group) vs transformers +
    torch AdamW on the whole batch."""
    for r in worlds[("train_ep2",)]:
        assert r["worst_rel"] <= 1e-4, f"weights differ from HF by rel {r['worst_rel']:.2e}"
        for ours, ref in zip(r["norms"], r["hf_norms"]):
            assert abs(ours - ref) <= 1e-5 * ref, f"grad norm {ours} vs HF {ref}"


def test_grouped_gemm_experts_match_transformers(worlds):
    """The experts as grouped GEMMs (torch._grouped_mm, what Hopper runs; forced here on the
    CPU) at EP=2 x TP=2: logits and, at EP=2, gradients vs transformers."""
    for rank, res in enumerate(worlds[("grouped_forward",)]):
        for key, err in res["errors"].items():
            assert err <= FWD_TOL, f"grouped rank {rank} {key}: max abs error {err:.3e}"
    for rank, res in enumerate(worlds[("grouped_gradients",)]):
        for family, r in res.items():
            assert r["worst_rel"] <= GRAD_TOL, (rank, family, r)
