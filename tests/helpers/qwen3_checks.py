"""Worker functions of the Qwen3 tests (run on gloo ranks; importable by spawned processes).

Each spawned run checks several things at once (the start of a run is the slow part): forward
errors vs transformers for every head x input layout x padding side, gradients, save round trips
and megatron-core's GPTModel loading hf2mcore output.
"""

from __future__ import annotations

import torch

from parallel_models.testing import TensorDictReader
from tests.helpers import generation_checks
from tests.helpers.model_checks import _batch, _hf_reference, ours_and_reference
from tests.helpers.pipeline_checks import _microbatches_packed


def _model_class(path: str, head: str, rmpad: bool, pp: bool = False):
    import parallel_models as pm
    from parallel_models.registry import architecture_of

    return pm.get_model_class(architecture_of(path), head, rmpad, pp)


def forward_errors(folders: dict, sp_settings=(False,)) -> dict:
    """``folders``: head -> HF folder. Max |ours - transformers| for each head x layout x side
    (x sequence parallel), full vocab; also the class name used."""

    out = {}
    for head, path in folders.items():
        for rmpad in (False, True):
            cls = _model_class(path, head, rmpad)
            for sp in sp_settings:
                model = cls.from_pretrained(path, dtype=torch.float32, sequence_parallel=sp)
                out[f"class-{head}-{rmpad}"] = type(model).__name__
                for side in ("left", "right"):
                    ids, mask = _batch(model.config.vocab_size, side)
                    got, ref = ours_and_reference(model, path, head, rmpad, ids, mask)
                    valid = mask.bool()
                    key = f"{head}-{'rmpad' if rmpad else 'padded'}-{side}{'-sp' if sp else ''}"
                    out[key] = (got - ref[valid]).abs().max().item()
    return out


def gradient_errors(path: str, tp: int, sp: bool) -> dict:
    """Relative error of every parameter's gradient (this rank's shard) vs transformers' after
    one cross-entropy backward; keys are our parameter names."""
    from megatron.core import parallel_state as mpu
    from transformers import AutoModelForCausalLM

    from parallel_models.llama.checkpoint_utils.weight_map import shard_from_hf, weight_rules
    from parallel_models.utils.grads import allreduce_sequence_parallel_grads
    from parallel_models.utils.padding import position_ids_from_attention_mask

    model = _model_class(path, "causal_lm", False).from_pretrained(
        path, dtype=torch.float32, sequence_parallel=sp)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, mask = _batch(model.config.vocab_size, "right", seed=3)
    pos = position_ids_from_attention_mask(mask)
    labels = ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    loss_of(hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits).backward()
    loss_of(model(ids, attention_mask=mask, full_vocab=True).logits).backward()
    allreduce_sequence_parallel_grads(model)  # norms (and q/k norms: partial over TP heads)
    grads = {n: p.grad for n, p in hf.named_parameters()}
    if hf.config.tie_word_embeddings:
        grads.setdefault("lm_head.weight", grads["model.embed_tokens.weight"])

    params = dict(model.named_parameters())
    rank = mpu.get_tensor_model_parallel_rank()
    out = {}
    for rule in weight_rules(model.config, "causal_lm"):
        for i in (range(model.config.num_layers) if rule.per_layer else [None]):
            want = shard_from_hf(rule, rule.hf_names(i), TensorDictReader(grads), model.config, tp, rank)
            got = params[rule.ours.format(i=i)].grad
            out[rule.ours.format(i=i)] = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    missing = set(params) - {r.ours.format(i=i) for r in weight_rules(model.config, "causal_lm")
                             for i in (range(model.config.num_layers) if r.per_layer else [None])}
    out["unchecked parameters"] = sorted(missing)
    return out


def tensor_parallel_run(folders: dict, tp: int, saves: list[dict], megatron_cases: list[dict]
                        ) -> dict:
    """At TP=``tp``: forward errors with and without SP, gradients with and without SP, the
    ``saves`` (checkpoint_checks.save_roundtrips jobs), megatron-core loading the
    ``megatron_cases`` (checkpoint_checks.megatron_loads cases) and rollout generation
    (generation_checks.check_generation)."""
    import parallel_models as pm
    from tests.helpers import checkpoint_checks as cc

    pm.init_parallel(tensor_parallel_size=tp)
    sp_settings = (False, True) if tp > 1 else (False,)
    out = {"forward": forward_errors(folders, sp_settings), "grads": {}}
    for sp in sp_settings:
        out["grads"][sp] = gradient_errors(folders["causal_lm"], tp, sp)
    out["saves"] = cc.save_roundtrips(saves, tp) if saves else {}
    out["megatron"] = cc.megatron_loads(megatron_cases, tp) if megatron_cases else {}
    # rollout: greedy decoding with the KV cache == transformers.generate (q/k norm on cached k)
    out["generation"] = generation_checks.check_generation(folders["causal_lm"], tp, False)
    return out


def pipeline_run(folders: dict, pp: int) -> dict:
    """PP=``pp`` (TP=1): max |ours - transformers| of the PP variants through megatron-core's
    schedule (``forward_only``), RmPad and padded, for each head."""
    import parallel_models as pm

    pm.init_parallel(pipeline_parallel_size=pp)
    out = {}
    for head, path in folders.items():
        for rmpad in (True, False):
            chunks = pm.build_pipeline_chunks(_model_class(path, head, rmpad, pp=True), path,
                                              dtype=torch.float32)
            ids, mask = _batch(chunks[0].config.vocab_size, "left", seed=5)
            ids, mask = torch.cat([ids, ids.flip(0)]), torch.cat([mask, mask.flip(0)])
            ref = _hf_reference(path, head, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
            kw = {"full_vocab": True} if head == "causal_lm" else {}
            if rmpad:
                mbs = [dict(mb, **kw) for mb in _microbatches_packed(ids, mask, 4)]
                fn = (lambda o, mb: o.logits) if head == "causal_lm" else (lambda o, mb: o.values)
                got = torch.cat(pm.forward_only(chunks, mbs, fn))
            else:
                mbs = [{"input_ids": i, "attention_mask": m, **kw}
                       for i, m in zip(ids.chunk(4), mask.chunk(4))]
                got = torch.cat(pm.forward_only(chunks, mbs))[mask.bool()]
            out[f"{head}-{'rmpad' if rmpad else 'padded'}"] = (got - ref[mask.bool()]).abs().max().item()
    return out
