"""``hf2mcore --format megatron-lm`` output through the argument handling of Megatron-LM's
``load_checkpoint`` and Megatron-Bridge's Megatron-LM compatibility path (issue 38 item 3): every
attribute they read is in the saved ``args``, megatron-core builds and validates the
TransformerConfig / GPTModel they would build from it, that model loads the checkpoint the way
Megatron-LM declares it (under ``"model"``) and matches transformers' logits. The MoE training
settings (issue 38 item 5) are Bridge's for the family, the aux-loss coefficient the HF one."""

import pytest

from parallel_models.testing import run_distributed
from tests.helpers import megatron_lm_args_checks
from tests.helpers.moe_checks import save_moe_model

TOL = 1e-4
CASES = {"qwen3_moe": dict(router_aux_loss_coef=0.003), "mixtral": dict(router_aux_loss_coef=0.02),
         "qwen2_moe": {}}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from conversion.hf2mcore import convert_hf_to_mcore
    from parallel_models.testing import save_tiny_hf_model

    root = tmp_path_factory.mktemp("mlm_args")
    cases = {}
    for family, kw in CASES.items():
        hf = save_moe_model(str(root / family), family, **kw)
        out = str(root / f"{family}_mlm")
        convert_hf_to_mcore(hf, out, progress=False, format="megatron-lm", layer_spec="mcore-local")
        cases[family] = (out, hf)
    # (plain RoPE: Bridge's _gpt_provider passes use_rope_scaling but not rope_scaling_factor, so
    # a llama3-scaled model there gets GPTModel's default factor 8)
    hf = save_tiny_hf_model(str(root / "llama"), "llama", rope_scaling=None)
    convert_hf_to_mcore(hf, str(root / "llama_mlm"), progress=False, format="megatron-lm")
    cases["llama"] = (str(root / "llama_mlm"), hf)
    return run_distributed(megatron_lm_args_checks.load_as_megatron_lm, 1, cases,
                           timeout=600)[0]


@pytest.mark.parametrize("name", [*CASES, "llama"])
def test_megatron_lm_args_load_through_their_argument_handling(loaded, name):
    r = loaded[name]
    assert r["missing"] == [], r
    assert r["iteration"] == 0 and r["version"] == 3.0, r
    assert r["logits"] <= TOL, r
    assert r["impl"] == ("transformer_engine" if name == "llama" else "local"), r


def test_moe_training_settings_are_bridges(loaded):
    assert loaded["qwen3_moe"]["moe"] == {"moe_layer_freq": [1, 0, 1],
                                          "moe_router_load_balancing_type": "aux_loss",
                                          "moe_aux_loss_coeff": 0.003, "moe_router_dtype": "fp32"}
    assert loaded["qwen2_moe"]["moe"]["moe_router_load_balancing_type"] == "aux_loss"
    assert loaded["mixtral"]["moe"] == {"moe_layer_freq": [1, 1],
                                        "moe_router_load_balancing_type": "none",
                                        "moe_aux_loss_coeff": 0.02, "moe_router_dtype": "fp32"}


def test_bridge_run_config_carries_the_training_settings(tmp_path):
    import yaml

    from conversion.hf2mcore import convert_hf_to_mcore

    hf = save_moe_model(str(tmp_path / "hf"), "qwen3_moe", router_aux_loss_coef=0.003)
    convert_hf_to_mcore(hf, str(tmp_path / "out"), progress=False)
    with open(tmp_path / "out" / "iter_0000000" / "run_config.yaml") as f:
        model = yaml.safe_load(f)["model"]
    assert {k: model[k] for k in ("moe_router_load_balancing_type", "moe_aux_loss_coeff",
                                  "moe_grouped_gemm", "moe_permute_fusion",
                                  "moe_router_dtype")} == {
        "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.003,
        "moe_grouped_gemm": True, "moe_permute_fusion": True, "moe_router_dtype": "fp32"}
