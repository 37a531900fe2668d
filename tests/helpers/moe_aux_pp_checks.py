"""Workers of tests/models/test_moe_aux_loss_pp.py (gloo ranks): the MoE load-balancing loss under
pipeline parallel, whose running totals ride between the stages with the activations
(``llama.layers.moe_aux_carry``), against transformers' ``aux_loss`` and against PP=1."""

from __future__ import annotations

import torch
import torch.nn.functional as F

COEF = 0.25
N_MICRO = 4


def _padded_batch(vocab: int, seed: int, lengths=(11, 4, 9, 6, 3, 10, 7, 5)):
    """Right-padded sequences of uneven lengths: the microbatches differ in token count (so the
    interleaved schedule pads them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, :n] = 1
    return ids, mask


def _hf_loss_and_aux(path: str, ids, mask, dtype=torch.float32):
    """transformers on each microbatch: sum_m (ce_sum_m + COEF * aux_m * n_m) / sum_m n_m (the
    global token mean the pipeline's loss is), backward; returns the model and each aux_m."""
    from transformers import AutoModelForCausalLM

    from parallel_models.utils.padding import position_ids_from_attention_mask

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    total, count, auxes = 0.0, 0, []
    for ids_m, mask_m in zip(ids.chunk(N_MICRO), mask.chunk(N_MICRO)):
        out = hf(input_ids=ids_m, attention_mask=mask_m,
                 position_ids=position_ids_from_attention_mask(mask_m), output_router_logits=True)
        labels = ids_m[:, 1:].masked_fill(~mask_m[:, 1:].bool(), -100)
        ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float(),
                             labels.reshape(-1), ignore_index=-100, reduction="sum")
        n = int((labels != -100).sum())
        total = total + ce + COEF * out.aux_loss * n
        count += n
        auxes.append(float(out.aux_loss.detach()))
    (total / count).backward()
    return hf, auxes


def _on_device(microbatches: list, model) -> list:
    """The microbatches' tensors on ``model``'s device (CUDA on a GPU host, for the NCCL run of
    tests/gpu/test_gpu_moe_aux_pp.py)."""
    dev = next(model.parameters()).device
    return [{k: v.to(dev) if torch.is_tensor(v) else v for k, v in mb.items()}
            for mb in microbatches]


def _router_grads(chunks, main_grad: bool = False) -> dict:
    """{global layer id: router-weight gradient} of this rank's chunks."""
    out = {}
    for c in chunks:
        for layer in c.model.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                g = router.weight.main_grad if main_grad else router.weight.grad
                out[layer.layer_id] = g.detach().float().cpu().clone()
    return out


def _pipeline_run(path: str, dtype, seed: int = 5) -> tuple[list, dict, list, tuple]:
    """One forward_backward of the CE loss + COEF * aux over N_MICRO microbatches through this
    rank's pipeline chunks (plain modules: gradients in ``.grad``): the per-microbatch aux
    values, this rank's router gradients, the layers of each chunk, and the batch."""
    import parallel_models as pm
    from parallel_models.llama.layers import moe_aux_loss
    from parallel_models.rl.roles.moe_aux import with_aux_loss
    from tests.helpers.pipeline_checks import _ce_loss_fn, _microbatches_packed

    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True, pp=True)
    chunks = pm.build_pipeline_chunks(cls, path, dtype=dtype)
    ids, mask = _padded_batch(chunks[0].config.vocab_size, seed)
    mbs = _on_device(_microbatches_packed(ids, mask, N_MICRO), chunks[0])
    for mb in mbs:
        mb["full_vocab"] = True
    moe_aux_loss.record_router_logits(chunks, True)
    try:
        metrics = pm.pipeline.forward_backward(chunks, mbs, with_aux_loss(_ce_loss_fn, chunks, COEF))
    finally:
        moe_aux_loss.record_router_logits(chunks, False)
    aux = [float(m["moe_aux_loss"] / m["tokens"]) for m in metrics]
    layers = [[layer.layer_id for layer in c.model.layers] for c in chunks]
    return aux, _router_grads(chunks), layers, (ids, mask)


def pp_vs_transformers(paths: dict, vpp: int | None, tp: int = 1) -> dict:
    """PP=2 (``vpp``: virtual chunks per rank; ``tp`` > 1: with sequence parallel, 2 x tp
    ranks) in fp32 vs transformers, per family: each microbatch's aux loss, and the worst
    relative error of this rank's router-weight gradients of (CE + COEF * aux) as a global
    token mean over the microbatches."""
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=2,
                     virtual_pipeline_parallel_size=vpp, sequence_parallel=tp > 1)
    out = {}
    for family, path in paths.items():
        aux, grads, layers, (ids, mask) = _pipeline_run(path, torch.float32)
        hf, want = _hf_loss_and_aux(path, ids, mask)
        hf_params = dict(hf.named_parameters())
        worst = 0.0
        for layer_id, grad in grads.items():
            ref = hf_params[f"model.layers.{layer_id}.mlp.gate.weight"].grad
            worst = max(worst, float((grad - ref).norm() / ref.norm()))
        out[family] = {"aux": aux, "hf_aux": want, "grad_rel": worst,
                       "router_layers": sorted(grads), "chunk_layers": layers}
    return out


def bf16_pp_equals_pp1(path: str) -> dict:
    """bf16 (the pipeline's messages in bf16: the carried sums travel as three bf16 pieces, and
    so does their gradient): PP=2 vs the same model at PP=1 run microbatch by microbatch on each
    rank (no collective; the same bf16 ops in the same order). The aux values and the router
    gradients must agree to fp32 rounding, far below one bf16 step."""
    import parallel_models as pm
    from megatron.core import parallel_state as mpu

    from parallel_models.llama.layers import moe_aux_loss
    from tests.helpers.pipeline_checks import _ce_loss_fn, _microbatches_packed

    pm.init_parallel(pipeline_parallel_size=2)
    aux, grads, _, (ids, mask) = _pipeline_run(path, torch.bfloat16)
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    pm.init_parallel()
    model = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm",
                               rmpad=True).from_pretrained(path, dtype=torch.bfloat16)
    moe_aux_loss.record_router_logits(model, True)
    ref_aux, count = [], 0
    for mb in _on_device(_microbatches_packed(ids, mask, N_MICRO), model):
        out = model(mb["input_ids"], mb["cu_seqlens"], mb["position_ids"], mb["max_seqlen"],
                    full_vocab=True)
        loss, n, _ = _ce_loss_fn(out, mb)
        a = moe_aux_loss.load_balancing_loss(model)
        (loss + COEF * a * n).backward()
        ref_aux.append(float(a))
        count += int(n)
    moe_aux_loss.record_router_logits(model, False)
    for p in model.parameters():  # the pipeline's global token mean, as _finalize_plain takes it
        if p.grad is not None:
            p.grad.mul_(1.0 / count)
    ref = _router_grads([model])
    worst = max(float((g - ref[i]).norm() / ref[i].norm()) for i, g in grads.items())
    return {"aux": aux, "ref_aux": ref_aux, "grad_rel": worst, "router_layers": sorted(grads),
            "pp_rank": pp_rank}


def actor_update_pp2_equals_pp1(path: str, max_tokens: int = 12) -> dict:
    """The RL stack's actor update (``PolicyRole.update`` with ``actor.moe_aux_loss_coef`` =
    COEF, several microbatches of at most ``max_tokens``) at PP=2 and at PP=1 (DP=2, the same
    batch on both ranks, so the data-parallel mean is that batch's): the update's metrics and
    this rank's router-weight gradients (the PP=1 run's for the same layers), plus the
    coefficient PP=2 takes by default (the model's ``router_aux_loss_coef``)."""
    import parallel_models as pm
    from megatron.core import parallel_state as mpu

    from parallel_models.rl.roles import moe_aux
    from parallel_models.rl.config import load_config
    from parallel_models.rl.roles.model_roles import PolicyRole, make_microbatches
    from parallel_models.utils.optimizer import build_optimizer
    from tests.helpers.moe_aux_checks import _batch

    arch = pm.registry.architecture_of(path)
    runs = {}
    for pp in (2, 1):
        pm.init_parallel(pipeline_parallel_size=pp)
        cfg = load_config(None, ["actor.clip_grad=0", f"actor.moe_aux_loss_coef={COEF}"])
        model = pm.get_model_class(arch, "causal_lm", rmpad=True, pp=pp > 1).from_pretrained(
            path, dtype=torch.float32)
        role = PolicyRole(model, build_optimizer([model], cfg.actor.optim_config(10)),
                          max_tokens=max_tokens, cfg=cfg.actor)
        batch = _batch(model.config.vocab_size, seed=5)
        batch["old_log_probs"] = role.log_probs(batch)
        metrics = role.update(batch)
        runs[pp] = (metrics, _router_grads([model], main_grad=True))
        if pp == 2:
            default = moe_aux.aux_loss_coef(load_config(None, []).actor, model.config)
            pp_rank = mpu.get_pipeline_model_parallel_rank()
            n_micro = len(make_microbatches(batch, max_tokens)[0])
    (got, grads), (want, ref) = runs[2], runs[1]
    worst = max(float((g - ref[i]).norm() / ref[i].norm()) for i, g in grads.items())
    return {"pp2": got, "pp1": want, "grad_rel": worst, "router_layers": sorted(grads),
            "default_coef": default, "pp_rank": pp_rank, "microbatches": n_micro}
