"""MoE families (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral) on megatron-core's
MoE layer against transformers on the same weights: fp32 logits/values max abs <= 1e-4, padded
(left and right) and RmPad, at TP=1, EP=2, TP=2 (+SP), TP=2 x EP=2 and PP=2 (a dense layer among
the MoE layers; odd vocab sizes, so never divisible by TP); gradients at EP=2 (rel <= 1e-4,
router and experts included). Routing is made tie-free by wide router margins, checked here."""

import pytest

from parallel_models.testing import run_distributed
from tests import moe_checkpoint_checks, moe_checks

FWD_TOL = 1e-4
GRAD_TOL = 1e-4
MIN_MARGIN = 1e-3  # smallest k-th vs (k+1)-th router logit gap: far above float rounding
# name -> (tp, ep, sp, heads)
SETTINGS = {"tp1": (1, 1, False, ("causal_lm", "value")),
            "ep2": (1, 2, False, ("causal_lm",)),
            "tp2_sp": (2, 1, True, ("causal_lm",)),
            "tp2_ep2": (2, 2, True, ("causal_lm",))}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {(family, head): moe_checks.save_moe_model(str(root / f"{family}_{head}"), family, head)
            for family in moe_checks.MOE_FAMILIES for head in ("causal_lm", "value")}


@pytest.fixture(scope="module")
def forward_results(moe_models):
    results = {}
    for name, (tp, ep, sp, heads) in SETTINGS.items():
        folders = {key: path for key, path in moe_models.items() if key[1] in heads}
        results[name] = run_distributed(moe_checks.check_moe_forward, tp * ep, folders, tp, ep,
                                        sp, timeout=300)
    return results


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


def test_moe_gradients_match_transformers_at_ep2(moe_models):
    folders = {k: v for k, v in moe_models.items() if k[1] == "causal_lm"}
    results = run_distributed(moe_checks.check_moe_gradients, 2, folders, 1, 2, timeout=300)
    for rank, res in enumerate(results):
        for family, r in res.items():
            assert r["checked"] > 0
            assert r["worst_rel"] <= GRAD_TOL, (f"rank {rank} {family}: {r['worst']} grad rel "
                                                f"error {r['worst_rel']:.3e}")


def test_moe_pipeline_forward_matches_transformers(moe_models):
    folders = {k: v for k, v in moe_models.items() if k[1] == "causal_lm"}
    results = run_distributed(moe_checks.check_moe_pp_forward, 2, folders, 1, 2, 1, timeout=300)
    stage_layers = [set(), set()]
    for rank, res in enumerate(results):
        for key, err in res.items():
            if key.endswith("-layers"):
                if key.startswith("qwen3_moe"):
                    stage_layers[rank].update(err)
                continue
            assert err <= FWD_TOL, f"PP=2 rank {rank} {key}: max abs error {err:.3e}"
    # tiny Qwen3-MoE: layers 0 and 2 MoE, layer 1 dense, split [2, 1] over the stages
    assert stage_layers == [{0, 1}, {2}]


@pytest.mark.parametrize("tp,ep,pp", [(2, 2, 1), (1, 2, 2)])
def test_moe_save_pretrained_round_trip_is_bit_exact(moe_models, tmp_path, tp, ep, pp):
    folders = {k: v for k, v in moe_models.items() if k[1] == "causal_lm"
               and (pp == 1 or k[0] == "qwen3_moe")}  # PP: the family with a dense layer
    results = run_distributed(moe_checkpoint_checks.check_moe_save_round_trip, tp * ep * pp, folders,
                              str(tmp_path), tp, ep, pp, timeout=300)
    for family, r in results[0].items():
        assert r["count"] > 0
        assert r["differ"] == [] and r["missing"] == [] and r["extra"] == [], (family, r)


def test_moe_load_balancing_loss_matches_transformers(moe_models):
    """At TP=2 (+SP: each rank routes half the tokens): value and router-weight gradients of
    the load-balancing loss vs transformers' aux_loss (output_router_logits=True)."""
    folders = {k: v for k, v in moe_models.items() if k[1] == "causal_lm"}
    results = run_distributed(moe_checks.check_moe_aux_loss, 2, folders, 2, 1, timeout=300)
    for rank, res in enumerate(results):
        for family, r in res.items():
            assert abs(r["ours"] - r["hf"]) <= 1e-5 * abs(r["hf"]), (rank, family, r)
            assert r["grad_rel"] <= GRAD_TOL, (rank, family, r)


def test_moe_hf2mcore_mcore2hf_round_trip_and_megatron_loads(moe_models, tmp_path):
    """HF -> hf2mcore -> mcore2hf bit-exact; megatron-core's own GPTModel (MoE block spec, local)
    at TP=2 x EP=2 loads the hf2mcore output and matches transformers, and so does ours."""
    folders = {k: v for k, v in moe_models.items() if k[1] == "causal_lm"}
    trips = moe_checkpoint_checks.convert_round_trip(folders, str(tmp_path))
    for family, r in trips.items():
        assert r["count"] > 0
        assert r["differ"] == [] and r["missing"] == [] and r["extra"] == [], (family, r)
    cases = {family: (folders[(family, "causal_lm")], r["mcore"]) for family, r in trips.items()}
    results = run_distributed(moe_checkpoint_checks.check_mcore_loads, 4, cases, 2, 2, timeout=300)
    for rank, res in enumerate(results):
        for family, r in res.items():
            assert r["megatron"] <= FWD_TOL, (rank, family, r)
            assert r["ours"] <= FWD_TOL, (rank, family, r)


def test_moe_save_mcore_round_trip_is_bit_exact(moe_models, tmp_path):
    folders = {k: v for k, v in moe_models.items() if k[1] == "causal_lm"}
    results = run_distributed(moe_checkpoint_checks.check_save_mcore_round_trip, 4, folders, str(tmp_path),
                              2, 2, timeout=300)
    for family, r in results[0].items():
        assert r["count"] > 0
        assert r["differ"] == [] and r["missing"] == [] and r["extra"] == [], (family, r)


def test_bad_moe_settings_are_named(moe_models, tmp_path):
    from parallel_models.testing import save_tiny_hf_model

    dense = save_tiny_hf_model(str(tmp_path / "dense"), "qwen2")
    three = moe_checks.save_moe_model(str(tmp_path / "three"), "qwen3_moe", num_experts=3)
    top1 = moe_checks.save_moe_model(str(tmp_path / "top1"), "mixtral", num_experts_per_tok=1)
    res = run_distributed(moe_checks.check_bad_moe_settings, 2, {
        "dense_with_ep": dense, "experts_not_divisible": three, "top1_normalized": top1,
        "aux_without_recording": moe_models[("qwen3_moe", "causal_lm")]}, 1, 2)[0]
    assert "expert_model_parallel_size=2" in res["dense_with_ep"] and "no MoE" in res["dense_with_ep"]
    assert "num_experts (3) is not divisible by expert_model_parallel_size (2)" in \
        res["experts_not_divisible"]
    assert "num_experts_per_tok=1 with norm_topk_prob" in res["top1_normalized"]
    assert "record_router_logits" in res["aux_without_recording"]
    init = run_distributed(moe_checks.check_bad_moe_settings, 2, {}, 2, 2)[0]
    assert "expert_model_parallel_size (2)" in init["init"] and "world size 2" in init["init"]


def test_moe_train_steps_at_ep2_match_hf_adamw(moe_models):
    """Two Adam steps through megatron-core's DDP and optimizer at EP=2 (expert gradients over
    the expert-data-parallel group, grad norm over the expert-parallel group) vs transformers +
    torch AdamW on the whole batch."""
    results = run_distributed(moe_checks.check_moe_train_steps, 2,
                              moe_models[("qwen2_moe", "causal_lm")], 2, timeout=300)
    for r in results:
        assert r["worst_rel"] <= 1e-4, f"weights differ from HF by rel {r['worst_rel']:.2e}"
        for ours, ref in zip(r["norms"], r["hf_norms"]):
            assert abs(ours - ref) <= 1e-5 * ref, f"grad norm {ours} vs HF {ref}"


def test_grouped_gemm_experts_match_transformers(moe_models):
    """The experts as grouped GEMMs (torch._grouped_mm, what Hopper runs; forced here on the
    CPU) at EP=2 x TP=2: logits and, at EP=2, gradients vs transformers."""
    folders = {k: v for k, v in moe_models.items() if k[1] == "causal_lm"}
    fwd = run_distributed(moe_checks.check_moe_forward, 4, folders, 2, 2, True, True,
                          timeout=300)
    for rank, res in enumerate(fwd):
        for key, err in res["errors"].items():
            assert err <= FWD_TOL, f"grouped rank {rank} {key}: max abs error {err:.3e}"
    grads = run_distributed(moe_checks.check_moe_gradients, 2, folders, 1, 2, True, timeout=300)
    for rank, res in enumerate(grads):
        for family, r in res.items():
            assert r["worst_rel"] <= GRAD_TOL, (rank, family, r)
