"""Pipeline-parallel variants and the training step on megatron-core (4 gloo ranks at most)."""

import pytest
import torch

from parallel_models.config import ConfigError
from parallel_models.pipeline import (LOSS_DATA_KEYS, MODEL_INPUT_KEYS, check_microbatch_keys,
                                      format_pipeline_layout, forward_only, pipeline_layout)
from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model
from tests.helpers import pipeline_checks

FWD_TOL = 1e-4
# name: (tp, pp, vpp, sp); world size 4 -> the rest is data parallel
FORWARD = {"tp2_pp2": (2, 2, None, False), "tp2_pp2_sp": (2, 2, None, True),
           "pp2_vpp2": (1, 2, 2, False), "pp4": (1, 4, None, False), "dp2_pp2": (1, 2, None, False)}


@pytest.fixture(scope="module")
def pp_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    return {(f, h): save_tiny_hf_model(str(root / f"{f}_{h}"), f, head=h, seed=1, num_hidden_layers=4)
            for f in ("llama", "qwen2") for h in ("causal_lm", "value")}


# the 4-rank checks share one spawned world, the 2-rank ones another (one start-up each)
TRAIN_4 = {"train_tp2_pp2": (("llama", "causal_lm"), 2, 2, None, 1),
           "dp2_pp2_distopt": (("llama", "causal_lm"), 1, 2, None, 2, True)}
TRAIN_2 = {"qwen2_pp2_3steps": (("qwen2", "causal_lm"), 1, 2, None, 3),
           "pp2_vpp2": (("llama", "causal_lm"), 1, 2, 2, 1)}


def _train_job(pp_models, model, *rest):
    return pipeline_checks.check_train_steps, (pp_models[model], *rest)


@pytest.fixture(scope="module")
def four_rank_results(pp_models):
    jobs = [(pipeline_checks.check_pp_forward, (pp_models, tp, pp, vpp, sp))
            for tp, pp, vpp, sp in FORWARD.values()]
    jobs += [_train_job(pp_models, *args) for args in TRAIN_4.values()]
    results = run_distributed_jobs(jobs, 4, timeout=900)
    assert not set(FORWARD) & set(TRAIN_4)
    return dict(zip([*FORWARD, *TRAIN_4], results))


@pytest.fixture(scope="module")
def forward_results(four_rank_results):
    return {name: four_rank_results[name] for name in FORWARD}


@pytest.fixture(scope="module")
def two_rank_results(pp_models):
    results = run_distributed_jobs([_train_job(pp_models, *args) for args in TRAIN_2.values()],
                                   2, timeout=400)
    return dict(zip(TRAIN_2, results))


@pytest.mark.parametrize("setting", list(FORWARD))
def test_pp_variants_match_transformers(forward_results, setting):
    for rank, errors in enumerate(forward_results[setting]):
        errors = {k: v for k, v in errors.items() if k != "typo_error"}
        assert len(errors) == 8
        for key, err in errors.items():
            assert err <= FWD_TOL, f"{setting} rank {rank} {key}: max abs error {err:.3e}"


@pytest.mark.parametrize("setting", list(FORWARD))
def test_misspelled_microbatch_key_raises_on_every_rank(forward_results, setting):
    """At TP=2 a dropped ``full_vocab`` would return this rank's vocab slice without an error."""
    for rank, errors in enumerate(forward_results[setting]):
        msg = errors["typo_error"]
        assert msg is not None, f"{setting} rank {rank}: 'full_vocabs' was accepted"
        assert "'full_vocabs' (did you mean 'full_vocab'?)" in msg
        for key in MODEL_INPUT_KEYS + LOSS_DATA_KEYS:
            assert key in msg, f"accepted key {key!r} missing from: {msg}"


def test_microbatch_key_check():
    ok = {"input_ids": torch.zeros(3, dtype=torch.long), "cu_seqlens": torch.tensor([0, 3]),
          "full_vocab": True, "response_mask": torch.ones(1, 2), "advantages": torch.zeros(1, 2)}
    check_microbatch_keys([ok, dict(ok)])
    with pytest.raises(ValueError, match=r"microbatch 1 has unknown key\(s\) 'label_mask'.*"
                                         r"extra_keys"):
        check_microbatch_keys([ok, {**ok, "label_mask": 1}])
    check_microbatch_keys([{**ok, "label_mask": 1}], extra_keys=("label_mask",))
    with pytest.raises(TypeError, match="microbatch 0 is a list"):
        check_microbatch_keys([[1, 2]])
    with pytest.raises(ValueError, match="'positions' \\(did you mean 'position_ids'\\?\\)"):
        forward_only([], [{**ok, "positions": None}])  # raises before any model code runs


def _assert_same_step(results, what):
    for r in results:
        assert r["worst_rel"] <= 1e-4, f"{what}: weights differ from HF by rel {r['worst_rel']:.2e}"
        for ours, ref in zip(r["norms"], r["hf_norms"]):
            assert abs(ours - ref) <= 1e-5 * ref, f"{what}: grad norm {ours} vs HF {ref}"


def test_train_step_tp2_pp2_matches_hf_adamw(four_rank_results):
    _assert_same_step(four_rank_results["train_tp2_pp2"], "TP=2 x PP=2")


def test_qwen2_tied_embeddings_stay_in_sync_over_pp(two_rank_results):
    results = two_rank_results["qwen2_pp2_3steps"]
    _assert_same_step(results, "Qwen2 PP=2, 3 steps")
    embed = next(r["tied"]["embed"] for r in results if "embed" in r["tied"])
    head = next(r["tied"]["head"] for r in results if "head" in r["tied"])
    assert torch.equal(embed, head), (embed - head).abs().max()


def test_train_dp2_pp2_distributed_optimizer(four_rank_results):
    _assert_same_step(four_rank_results["dp2_pp2_distopt"], "DP=2 x PP=2, distributed optimizer")


def test_train_interleaved_pp2_vpp2(two_rank_results):
    _assert_same_step(two_rank_results["pp2_vpp2"], "PP=2 x VPP=2")


def test_pipeline_layout_interleaves_chunks():
    layout = pipeline_layout(8, 2, 2)
    assert [s.layer_ids for s in layout[0]] == [(0, 1), (4, 5)]
    assert [s.layer_ids for s in layout[1]] == [(2, 3), (6, 7)]
    assert layout[0][0].pre_process and not layout[0][1].pre_process
    assert layout[1][1].post_process and not layout[1][0].post_process
    assert "pp_rank 1 chunk 1: layers 6-7 norm+head" in format_pipeline_layout(8, 2, 2)


def test_pipeline_layout_uneven():
    with pytest.raises(ConfigError, match=r"num_layers \(7\).*pipeline_parallel_size \(2\).*layers_per_stage"):
        pipeline_layout(7, 2)
    layout = pipeline_layout(7, 2, layers_per_stage=[3, 4])
    assert layout[0][0].layer_ids == (0, 1, 2) and layout[1][0].layer_ids == (3, 4, 5, 6)
    with pytest.raises(ConfigError, match="summing to num_layers"):
        pipeline_layout(7, 2, layers_per_stage=[3, 3])
