"""Worker functions for the pipeline-parallel tests (run on gloo ranks)."""

from __future__ import annotations

import torch

from tests.model_checks import _batch, _hf_reference


def _microbatches_packed(ids, mask, n_micro):
    from parallel_models.utils.padding import pack_padded_batch

    out = []
    for chunk_ids, chunk_mask in zip(ids.chunk(n_micro), mask.chunk(n_micro)):
        p = pack_padded_batch(chunk_ids, chunk_mask)
        out.append({"input_ids": p.input_ids, "cu_seqlens": p.cu_seqlens,
                    "position_ids": p.position_ids, "max_seqlen": p.max_seqlen,
                    "mask": chunk_mask})
    return out


def check_pp_forward(folders: dict, tp: int, pp: int, vpp: int | None, sp: bool = False) -> dict:
    """Max abs error vs transformers of the PP variants (RmPad and padded, CausalLM and Value)."""
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
