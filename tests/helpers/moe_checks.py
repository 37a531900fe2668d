"""Worker functions run on gloo ranks by the MoE tests (tests/models/test_moe.py); importable by spawned
processes. Each returns plain numbers (or small tensors) the parent test asserts one by one."""

from __future__ import annotations

import torch

from parallel_models.testing import TensorDictReader
from tests.helpers.model_checks import _batch, _hf_reference, ours_and_reference

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
    from parallel_models.testing import save_tiny_hf_model

    return save_tiny_hf_model(path, family, head=head, seed=seed, router_scale=ROUTER_SCALE,
                              **overrides)


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


def check_moe_forward(folders: dict, tp: int, ep: int, sp: bool, grouped: bool = False) -> dict:
    """Max abs error vs transformers for every MoE family x head x padding x layout, at TP x EP
    (world = TP x EP: the dense layers run data parallel over the EP ranks). ``grouped``: the
    experts as grouped GEMMs (``torch._grouped_mm``, forced on the CPU)."""
    import parallel_models as pm
    from parallel_models.options import set_options

    set_options({"moe_grouped_gemm": bool(grouped)})

    pm.init_parallel(tensor_parallel_size=tp, sequence_parallel=sp, expert_model_parallel_size=ep)
    errors, margins = {}, {}
    for (family, head), path in folders.items():
        for rmpad in (False, True):
            cls = pm.get_model_class(ARCH[family], head, rmpad)
            model = cls.from_pretrained(path, dtype=torch.float32)
            model.eval()
            for side in ("left", "right"):
                ids, mask = _batch(model.config.vocab_size, side)
                got, ref = ours_and_reference(model, path, head, rmpad, ids, mask)
                valid = mask.bool()
                key = f"{family}-{head}-{'rmpad' if rmpad else 'padded'}-{side}"
                errors[key] = (got - ref[valid]).abs().max().item()
                if not rmpad:
                    margins[key] = _router_margin(path, head, ids, mask)
    return {"errors": errors, "margins": margins}


def check_moe_gradients(folders: dict, tp: int, ep: int, grouped: bool = False) -> dict:
    """Worst relative gradient error vs transformers after one cross-entropy backward, every
    parameter (router and experts included), at TP x EP. Each data-parallel rank takes its share
    of the sequences; dense gradients are summed over the data-parallel group and expert
    gradients over the expert-data-parallel group, as megatron-core's DDP does."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from transformers import AutoModelForCausalLM

    import parallel_models as pm
    from parallel_models.utils.grads import allreduce_sequence_parallel_grads
    from parallel_models.utils.padding import position_ids_from_attention_mask

    from parallel_models.options import set_options

    set_options({"moe_grouped_gemm": bool(grouped)})
    pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    out = {}
    for (family, head), path in folders.items():
        if head != "causal_lm":
            continue
        model = pm.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids, mask = _batch(model.config.vocab_size, "right", seed=3)
        labels = ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)
        count = int((labels != -100).sum())

        def loss_sum(logits, labels):
            return torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                ignore_index=-100, reduction="sum")

        pos = position_ids_from_attention_mask(mask)
        (loss_sum(hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits, labels)
         / count).backward()
        mine = slice(dp_rank, None, dp)  # this data-parallel rank's sequences
        logits = model(ids[mine], attention_mask=mask[mine], full_vocab=True).logits
        (loss_sum(logits, labels[mine]) / count).backward()
        allreduce_sequence_parallel_grads(model)
        for p in model.parameters():
            expert = getattr(p, "allreduce", True) is False
            group = (mpu.get_expert_data_parallel_group() if expert
                     else mpu.get_data_parallel_group())
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
        out[family] = _worst_grad_error(model, hf, tp)
    return out


def _worst_grad_error(model, hf, tp: int) -> dict:
    """Per-parameter relative error of our gradients vs HF's, read through the weight map."""
    from megatron.core import parallel_state as mpu

    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    # transformers 5 keeps the experts fused in memory ([E, 2I, H] gate_up, [E, H, I] down);
    # the weight map names them per expert as they are saved
    for name in list(hf_grads):
        for fused, parts in (("experts.gate_up_proj", ("gate_proj", "up_proj")),
                             ("experts.down_proj", ("down_proj",))):
            if not name.endswith(fused):
                continue
            grad = hf_grads.pop(name)
            prefix = name[: -len(fused)] + "experts."
            names = parts
            if ".block_sparse_moe." in prefix or "mixtral" in type(hf).__name__.lower():
                names = ("w1", "w3") if len(parts) == 2 else ("w2",)
            for e in range(grad.shape[0]):
                pieces = grad[e].chunk(len(parts), dim=0)
                for n, piece in zip(names, pieces):
                    hf_grads[f"{prefix}{e}.{n}.weight"] = piece
    mixtral = "mixtral" in type(hf).__name__.lower()
    if mixtral:  # in memory under mlp., on disk under block_sparse_moe.
        hf_grads = {n.replace(".mlp.gate.", ".block_sparse_moe.gate.")
                    .replace(".mlp.experts.", ".block_sparse_moe.experts."): g
                    for n, g in hf_grads.items()}

    config = model.config
    params = dict(model.named_parameters())
    ep, ep_rank = mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    worst, worst_name, checked = 0.0, None, 0
    for m in model.weight_map.mappings(config, "causal_lm"):
        local_expert = m.local_expert(config, ep, ep_rank) if m.expert is not None else None
        if m.expert is not None and local_expert is None:
            continue
        for i in (range(config.num_layers) if m.per_layer else [None]):
            if not m.applies_to(config, i):
                continue
            want = m.rule.shard(TensorDictReader(hf_grads), m.hf_names(i), config, tp, tp_rank)
            got = params[m.ours_name(i, local_expert)].grad
            rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            checked += 1
            if rel > worst:
                worst, worst_name = rel, m.ours_name(i, local_expert)
    return {"worst_rel": worst, "worst": worst_name, "checked": checked}


def check_moe_pp_forward(folders: dict, tp: int, pp: int, ep: int) -> dict:
    """Max abs error vs transformers of the PP variants (RmPad and padded microbatches) of every
    MoE family, through megatron-core's pipeline schedule."""
    import parallel_models as pm
    from tests.helpers.pipeline_checks import _microbatches_packed

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     expert_model_parallel_size=ep)
    errors = {}
    for (family, head), path in folders.items():
        for rmpad in (True, False):
            cls = pm.get_model_class(ARCH[family], head, rmpad, pp=True)
            layers = pm.ModelConfig.from_hf(path).num_layers
            split = [layers - layers // 2, layers // 2] if pp == 2 and layers % 2 else None
            chunks = pm.build_pipeline_chunks(cls, path, dtype=torch.float32,
                                              layers_per_stage=split)
            ids, mask = _batch(chunks[0].config.vocab_size, "left", seed=5)
            ref = _hf_reference(path, head, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
            kw = {"full_vocab": True} if head == "causal_lm" else {}
            if rmpad:
                mbs = [{**mb, **kw} for mb in _microbatches_packed(ids, mask, 2)]
                got = torch.cat(pm.forward_only(chunks, mbs))
            else:
                mbs = [{"input_ids": i, "attention_mask": m, **kw}
                       for i, m in zip(ids.chunk(2), mask.chunk(2))]
                got = torch.cat(pm.forward_only(chunks, mbs))[mask.bool()]
            key = f"{family}-{head}-{'rmpad' if rmpad else 'padded'}"
            errors[key] = (got - ref[mask.bool()]).abs().max().item()
            errors[key + "-layers"] = [layer.layer_id for c in chunks for layer in c.model.layers]
    return errors


def check_moe_aux_loss(folders: dict, tp: int, ep: int) -> dict:
    """Our load-balancing loss vs transformers' ``aux_loss`` (same batch on every rank; padded
    input) and, per family, the relative error of the router-weight gradients of that loss."""
    from megatron.core import parallel_state as mpu
    from transformers import AutoModelForCausalLM

    import parallel_models as pm
    from parallel_models.utils.grads import allreduce_sequence_parallel_grads
    from parallel_models.utils.padding import position_ids_from_attention_mask

    pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep)
    out = {}
    for (family, head), path in folders.items():
        if head != "causal_lm":
            continue
        model = pm.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids, mask = _batch(model.config.vocab_size, "left", seed=7)
        pos = position_ids_from_attention_mask(mask)
        want = hf(input_ids=ids, attention_mask=mask, position_ids=pos,
                  output_router_logits=True).aux_loss
        want.backward()
        model.record_router_logits(True)
        model(ids, attention_mask=mask)
        got = model.router_aux_loss()
        got.backward()
        allreduce_sequence_parallel_grads(model)
        config = model.config
        worst = 0.0
        for layer in model.model.layers:
            if not config.is_moe_layer(layer.layer_id):
                continue
            mine = layer.mlp.router.weight.grad
            ref = dict(hf.named_parameters())[f"model.layers.{layer.layer_id}.mlp.gate.weight"].grad
            worst = max(worst, ((mine - ref).norm() / ref.norm()).item())
        model.record_router_logits(False)
        out[family] = {"ours": got.item(), "hf": want.item(), "grad_rel": worst,
                       "tp_rank": mpu.get_tensor_model_parallel_rank()}
    return out


def check_bad_moe_settings(paths: dict, tp: int, ep: int) -> dict:
    """The errors bad MoE settings give, by case (message, or 'no error')."""
    import parallel_models as pm

    out = {}
    try:
        pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep)
    except ValueError as err:
        return {"init": str(err)}
    for name, path in paths.items():
        try:
            model = pm.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            if name == "aux_without_recording":
                model(torch.tensor([[1, 2, 3]]))
                model.router_aux_loss()
            out[name] = "no error"
        except (pm.ConfigError, RuntimeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def check_moe_train_steps(path: str, ep: int, steps: int = 2) -> dict:
    """``steps`` Adam steps (clip 1.0) through megatron DDP + optimizer at EP (DP = EP ranks,
    each with its share of the sequences) vs transformers + torch AdamW: grad norms and the
    worst relative weight difference afterwards (experts and router included)."""
    from megatron.core import parallel_state as mpu

    import parallel_models as pm
    from parallel_models.pipeline import train_step
    from parallel_models.utils.optimizer import OptimConfig, build_optimizer
    from tests.helpers.pipeline_checks import _ce_loss_fn, _hf_train, _microbatches_packed

    pm.init_parallel(expert_model_parallel_size=ep)
    lr, wd, clip = 1e-3, 0.01, 1.0
    chunks = pm.build_pipeline_chunks(pm.get_model_class(
        pm.registry.architecture_of(path), "causal_lm", rmpad=True, pp=True), path,
        dtype=torch.float32)
    state = build_optimizer(chunks, OptimConfig(lr=lr, weight_decay=wd, clip_grad=clip))
    ids, mask = _batch(chunks[0].config.vocab_size, "right", seed=7)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    local_ids, local_mask = ids.chunk(dp)[dp_rank], mask.chunk(dp)[dp_rank]
    norms = []
    for _ in range(steps):
        mbs = _microbatches_packed(local_ids, local_mask, 2)
        for mb in mbs:
            mb["full_vocab"] = True
        norms.append(train_step(state, mbs, _ce_loss_fn)["grad_norm"])
    hf, hf_norms = _hf_train(path, ids, mask, steps, lr, wd, clip)
    model = chunks[0]
    model = getattr(model, "module", model)
    hf_params = {n: p.detach() for n, p in hf.named_parameters()}
    for name in list(hf_params):  # fused in memory, per expert on disk (the weight map's names)
        for fused, parts in (("experts.gate_up_proj", 2), ("experts.down_proj", 1)):
            if name.endswith(fused):
                t = hf_params.pop(name)
                names = ("gate_proj", "up_proj") if parts == 2 else ("down_proj",)
                for e in range(t.shape[0]):
                    for n, piece in zip(names, t[e].chunk(parts, dim=0)):
                        hf_params[f"{name[:-len(fused)]}experts.{e}.{n}.weight"] = piece

    config = model.config
    params = dict(model.named_parameters())
    worst, worst_name = 0.0, None
    for m in model.weight_map.mappings(config, "causal_lm"):
        local = m.local_expert(config, ep, mpu.get_expert_model_parallel_rank()) \
            if m.expert is not None else None
        if m.expert is not None and local is None:
            continue
        for i in (range(config.num_layers) if m.per_layer else [None]):
            if m.applies_to(config, i):
                want = m.rule.shard(TensorDictReader(hf_params), m.hf_names(i), config, 1, 0)
                got = params[m.ours_name(i, local)].detach()
                rel = ((got - want).norm() / want.norm()).item()
                if rel > worst:
                    worst, worst_name = rel, m.ours_name(i, local)
    return {"norms": norms, "hf_norms": hf_norms, "worst_rel": worst, "worst": worst_name}
