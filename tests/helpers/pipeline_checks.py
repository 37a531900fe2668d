"""Worker functions for the pipeline-parallel tests (run on gloo ranks)."""

from __future__ import annotations

import torch

from parallel_models.testing import TensorDictReader
from tests.helpers.model_checks import _batch, _hf_reference


def _microbatches_packed(ids, mask, n_micro):
    from parallel_models.utils.padding import pack_padded_batch

    out = []
    for chunk_ids, chunk_mask in zip(ids.chunk(n_micro), mask.chunk(n_micro)):
        p = pack_padded_batch(chunk_ids, chunk_mask)
        out.append({"input_ids": p.input_ids, "cu_seqlens": p.cu_seqlens,
                    "position_ids": p.position_ids, "max_seqlen": p.max_seqlen})
    return out


def check_pp_forward(folders: dict, tp: int, pp: int, vpp: int | None, sp: bool = False) -> dict:
    """Max abs error vs transformers of the PP variants (RmPad and padded, CausalLM and Value),
    and the error a misspelled ``full_vocab`` microbatch key gives (``typo_error``)."""
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     virtual_pipeline_parallel_size=vpp, sequence_parallel=sp)
    errors = {}
    for (family, head), path in folders.items():
        arch = "LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM"
        for rmpad in (True, False):
            cls = pm.get_model_class(arch, head, rmpad, pp=True)
            chunks = pm.build_pipeline_chunks(cls, path, dtype=torch.float32)
            ids, mask = _batch(chunks[0].config.vocab_size, "left", seed=5)
            ids, mask = torch.cat([ids, ids.flip(0)]), torch.cat([mask, mask.flip(0)])
            ref = _hf_reference(path, head, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
            n_micro = 4
            if rmpad:
                mbs = _microbatches_packed(ids, mask, n_micro)
                fn = (lambda out, mb: out.logits) if head == "causal_lm" else (lambda out, mb: out.values)
                kw = {"full_vocab": True} if head == "causal_lm" else {}
                if kw and "typo_error" not in errors:
                    typo = [{**mb, "full_vocabs": True} for mb in mbs]
                    try:
                        pm.forward_only(chunks, typo, fn)
                        errors["typo_error"] = None
                    except ValueError as err:
                        errors["typo_error"] = str(err)
                for mb in mbs:
                    mb.update(kw)
                outs = pm.forward_only(chunks, mbs, fn)
                got = torch.cat(outs)
                want = ref[mask.bool()]
            else:
                mbs = [{"input_ids": i, "attention_mask": m, **({"full_vocab": True} if head == "causal_lm" else {})}
                       for i, m in zip(ids.chunk(n_micro), mask.chunk(n_micro))]
                outs = pm.forward_only(chunks, mbs)
                got = torch.cat(outs)[mask.bool()]
                want = ref[mask.bool()]
            errors[f"{family}-{head}-{'rmpad' if rmpad else 'padded'}"] = (got - want).abs().max().item()
    return errors


def _packed_labels(input_ids, cu_seqlens):
    labels = torch.full_like(input_ids, -100)
    labels[:-1] = input_ids[1:]
    labels[(cu_seqlens[1:] - 1).long()] = -100  # no target after a sequence's last token
    return labels


def _ce_loss_fn(out, mb):
    labels = _packed_labels(mb["input_ids"], mb["cu_seqlens"])
    loss = torch.nn.functional.cross_entropy(out.logits.float(), labels, ignore_index=-100,
                                             reduction="sum")
    n = (labels != -100).sum()
    return loss, n, {"loss_sum": loss.detach().clone(), "tokens": n.clone()}


def _hf_train(path, ids, mask, steps, lr, wd, clip):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    decay = [p for n, p in hf.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in hf.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-8)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1), ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)))
        opt.step()
    return hf, norms


def check_train_steps(path: str, tp: int, pp: int, vpp: int | None, steps: int,
                      distributed_optimizer: bool = False) -> dict:
    """``steps`` Adam steps (clip 1.0) on our PP model vs transformers + torch AdamW."""
    import parallel_models as pm
    from megatron.core import parallel_state as mpu

    from parallel_models.llama.checkpoint_utils.weight_map import shard_from_hf, weight_rules
    from parallel_models.pipeline import train_step
    from parallel_models.utils.optimizer import OptimConfig, build_optimizer

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     virtual_pipeline_parallel_size=vpp)
    lr, wd, clip = 1e-3, 0.01, 1.0
    chunks = pm.build_pipeline_chunks(pm.get_model_class(
        pm.registry.architecture_of(path), "causal_lm", rmpad=True, pp=True), path,
        dtype=torch.float32)
    state = build_optimizer(chunks, OptimConfig(lr=lr, weight_decay=wd, clip_grad=clip,
                                                use_distributed_optimizer=distributed_optimizer))
    ids, mask = _batch(chunks[0].config.vocab_size, "right", seed=7)
    ids, mask = torch.cat([ids, ids.roll(1, 0)]), torch.cat([mask, mask.roll(1, 0)])
    # data parallel: each DP rank takes its share of the sequences
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    local_ids, local_mask = ids.chunk(dp)[dp_rank], mask.chunk(dp)[dp_rank]
    norms = []
    for _ in range(steps):
        for mb in (mbs := _microbatches_packed(local_ids, local_mask, 4 // dp)):
            mb["full_vocab"] = True
        metrics = train_step(state, mbs, _ce_loss_fn)
        norms.append(metrics["grad_norm"])
    hf, hf_norms = _hf_train(path, ids, mask, steps, lr, wd, clip)
    hf_params = dict(hf.named_parameters())
    if hf.config.tie_word_embeddings:
        hf_params["lm_head.weight"] = hf_params["model.embed_tokens.weight"]

    worst, tp_rank = 0.0, mpu.get_tensor_model_parallel_rank()
    tied = {}
    for c in chunks:
        params = dict(c.named_parameters())
        for rule in weight_rules(c.config, "causal_lm", pre_process=c.pre_process,
                                 post_process=c.post_process):
            pairs = ([(li, layer.layer_id) for li, layer in enumerate(c.model.layers)]
                     if rule.per_layer else [(None, None)])
            for li, gi in pairs:
                want = shard_from_hf(rule, tuple(n.format(i=gi) for n in rule.hf),
                                     TensorDictReader(hf_params),
                                     c.config, tp, tp_rank)
                got = params[rule.ours.format(i=li)].detach()
                worst = max(worst, ((got - want).norm() / want.norm()).item())
        if c.config.tie_word_embeddings:
            if c.pre_process:
                tied["embed"] = c.model.embed_tokens.weight.detach().clone()
            if c.post_process and not c.pre_process:
                tied["head"] = c.lm_head.weight.detach().clone()
    return {"worst_rel": worst, "norms": norms, "hf_norms": hf_norms, "tied": tied,
            "pp_rank": mpu.get_pipeline_model_parallel_rank(), "tp_rank": tp_rank}


def check_fused_wgrad_train_steps(path: str, tp: int, pp: int, steps: int) -> dict:
    """:func:`check_train_steps` with the weight-gradient accumulation fused into the grad
    buffers (``utils/wgrad_fusion.py``, forced on: on the CPU it is off by default), counting the
    fused GEMMs so that a run which silently took the unfused path fails."""
    from parallel_models.options import options_override
    from parallel_models.utils import wgrad_fusion

    calls = {"n": 0}
    accumulate = wgrad_fusion._accumulate

    def counted(total_input, grad_output, main_grad):
        calls["n"] += 1
        accumulate(total_input, grad_output, main_grad)

    wgrad_fusion.extension.wgrad_gemm_accum_fp32 = counted
    try:
        with options_override(wgrad_fusion=True):
            out = check_train_steps(path, tp, pp, None, steps)
    finally:
        wgrad_fusion.extension.wgrad_gemm_accum_fp32 = accumulate
    return {**out, "fused_gemms": calls["n"]}
