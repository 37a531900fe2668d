"""Worker of tests/rl/test_moe_aux_loss.py (gloo ranks): the actor update's MoE load-balancing term
against transformers' ``aux_loss`` (``output_router_logits=True``) on the same batch."""

from __future__ import annotations

import torch

COEF = 0.25


def _batch(vocab: int, seed: int):
    """Prompts left-padded to 6, responses right-padded to 5, in the PPO batch layout."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, resp_lens = [6, 3, 5, 2], [5, 2, 4, 3]
    B, P, R = len(prompt_lens), 6, 5
    seqs = torch.zeros(B, P + R, dtype=torch.long)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    resp_mask = torch.zeros(B, R)
    for b, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        seqs[b, P - p:P + r] = torch.randint(3, vocab, (p + r,), generator=g)
        mask[b, P - p:P + r] = 1
        resp_mask[b, :r] = 1
    return {"sequences": seqs, "attention_mask": mask, "prompt_lengths": mask[:, :P].sum(-1),
            "response_mask": resp_mask, "advantages": torch.randn(B, R, generator=g) * resp_mask}


def _router_grads(model) -> dict:
    out = {}
    for layer in model.model.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            out[layer.layer_id] = router.weight.main_grad.detach().clone()
    return out


def aux_term_vs_transformers(path: str) -> dict:
    """One actor update with ``actor.moe_aux_loss_coef`` = COEF and one with 0 (fresh models,
    same batch, one microbatch): the reported ``actor/moe_aux_loss`` and the difference of the
    router-weight gradients, vs transformers' aux_loss and COEF times its gradient; and the
    default coefficient (the model's ``router_aux_loss_coef``)."""
    from transformers import AutoModelForCausalLM

    import parallel_models as pm
    from parallel_models.rl.config import load_config
    from parallel_models.rl.roles.model_roles import PolicyRole
    from parallel_models.utils.optimizer import build_optimizer
    from parallel_models.utils.padding import position_ids_from_attention_mask

    pm.init_parallel()
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    runs = {}
    for coef in (COEF, 0.0, None):
        cfg = load_config(None, ["actor.clip_grad=0",
                                 f"actor.moe_aux_loss_coef={'null' if coef is None else coef}"])
        model = cls.from_pretrained(path, dtype=torch.float32)
        role = PolicyRole(model, build_optimizer([model], cfg.actor.optim_config(10)),
                          max_tokens=4096, cfg=cfg.actor)
        batch = _batch(model.config.vocab_size, seed=5)
        batch["old_log_probs"] = role.log_probs(batch)
        metrics = role.update(batch)
        runs[coef] = (metrics, _router_grads(model), model.config.router_aux_loss_coef)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask = batch["sequences"], batch["attention_mask"]
    want = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_attention_mask(mask),
              output_router_logits=True).aux_loss
    want.backward()
    hf_params = dict(hf.named_parameters())
    worst = 0.0
    with_aux, without = runs[COEF][1], runs[0.0][1]
    for layer_id, grad in with_aux.items():
        ref = COEF * hf_params[f"model.layers.{layer_id}.mlp.gate.weight"].grad
        worst = max(worst, float((grad - without[layer_id] - ref).norm() / ref.norm()))
    return {"ours": runs[COEF][0]["actor/moe_aux_loss"], "hf": float(want), "grad_rel": worst,
            "router_layers": sorted(with_aux),
            "off_has_metric": "actor/moe_aux_loss" in runs[0.0][0],
            "default": runs[None][0].get("actor/moe_aux_loss"), "model_coef": runs[None][2],
            "pg_loss": [runs[c][0]["actor/pg_loss"] for c in (COEF, 0.0)]}
