"""The MoE load-balancing loss in the actor update (``actor.moe_aux_loss_coef``,
``rl/roles/moe_aux.py``): the reported ``actor/moe_aux_loss`` and its gradient equal transformers'
aux_loss on the same batch; 0 turns it off; null takes the model's router_aux_loss_coef."""

from parallel_models.testing import run_distributed, save_tiny_hf_model
from tests.helpers import moe_aux_checks


def test_actor_aux_loss_equals_transformers(tmp_path):
    path = save_tiny_hf_model(str(tmp_path / "moe"), "qwen3_moe", seed=2,
                              router_aux_loss_coef=0.01)
    res = run_distributed(moe_aux_checks.aux_term_vs_transformers, 1, path, timeout=300)[0]
    assert abs(res["ours"] - res["hf"]) <= 1e-5 * abs(res["hf"]), res
    assert res["router_layers"], "no MoE layer"
    assert res["grad_rel"] <= 1e-4, res
    assert not res["off_has_metric"]
    assert res["model_coef"] == 0.01 and abs(res["default"] - res["hf"]) <= 1e-5 * res["hf"]
    a, b = res["pg_loss"]
    assert abs(a - b) <= 1e-6 * abs(b), "the aux term leaked into pg_loss"
