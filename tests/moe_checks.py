"""Worker functions run on gloo ranks by the MoE tests (tests/test_moe.py); importable by spawned
processes. Each returns plain numbers (or small tensors) the parent test asserts one by one."""

from __future__ import annotations

import torch

from tests.model_checks import _batch, _hf_reference

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
        "mixtral": "MixtralForCausalLM"}
# router weights scaled up so that the k-th and (k+1)-th expert of every token are far apart:
# float rounding differences (~1e-6) can then never flip a routing decision
ROUTER_SCALE = 25.0


def save_moe_model(path: str, family: str, head: str = "causal_lm", seed: int = 1, **overrides
                   ) -> str:
    """A tiny random HF MoE model with wide router margins and randomized norms (so every tensor
    matters), saved with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from parallel_models.testing import tiny_hf_config

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    if head == "value":
        config.num_labels = 1
        config.architectures = [config.architectures[0].replace("CausalLM",
                                                                "SequenceClassification")]
        config.pad_token_id = 0
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # the router (not shared_expert_gate)
                p.normal_(0.0, 0.02).mul_(ROUTER_SCALE)
            if name.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def _router_margin(path: str, head: str, ids, mask) -> float:
    """Smallest gap, over real tokens and MoE layers, between the k-th and (k+1)-th router logit
    of transformers' model (a wide gap = tie-free routing)."""
    from transformers import AutoModelForCausalLM

    if head != "causal_lm":
        return float("inf")
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out = hf(input_ids=ids, attention_mask=mask, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    valid = mask.bool().reshape(-1)
    gaps = []
    for logits in out.router_logits:
        top = logits.reshape(valid.shape[0], -1)[valid].topk(k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min())
    return float(torch.stack(gaps).min())


def check_moe_forward(folders: dict, tp: int, ep: int, sp: bool) -> dict:
    """Max abs error vs transformers for every MoE family x head x padding x layout, at TP x EP
    (world = TP x EP: the dense layers run data parallel over the EP ranks)."""
    import parallel_models as pm
    from parallel_models.utils.padding import pack_padded_batch, position_ids_from_attention_mask

    pm.init_parallel(tensor_parallel_size=tp, sequence_parallel=sp, expert_model_parallel_size=ep)
    errors, margins = {}, {}
    for (family, head), path in folders.items():
        for rmpad in (False, True):
            cls = pm.get_model_class(ARCH[family], head, rmpad)
            model = cls.from_pretrained(path, dtype=torch.float32)
            model.eval()
            for side in ("left", "right"):
                ids, mask = _batch(model.config.vocab_size, side)
                pos = position_ids_from_attention_mask(mask)
                ref = _hf_reference(path, head, ids, mask, pos)
                valid = mask.bool()
                kw = dict(full_vocab=True) if head == "causal_lm" else {}
                with torch.no_grad():
                    if rmpad:
                        packed = pack_padded_batch(ids, mask)
                        out = model(packed.input_ids, packed.cu_seqlens, **kw)
                        got = out.logits if head == "causal_lm" else out.values
                    else:
                        out = model(ids, attention_mask=mask, **kw)
                        got = (out.logits if head == "causal_lm" else out.values)[valid]
                key = f"{family}-{head}-{'rmpad' if rmpad else 'padded'}-{side}"
                errors[key] = (got - ref[valid]).abs().max().item()
                if not rmpad:
                    margins[key] = _router_margin(path, head, ids, mask)
    return {"errors": errors, "margins": margins}
