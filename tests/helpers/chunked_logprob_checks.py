"""Workers for tests/distributed/test_chunked_logprob.py: the token-chunked head + log-prob path
(``parallel_models/utils/chunked_logprob.py``) against the unchunked one (the LM head's logits,
then ``vocab_parallel``) in the same ranks, on the same tiny checkpoint and packed batch.

:func:`head_parity`: the final hidden states of the model through both paths (TP, SP, tied or
not, float32 or bf16); the log-probs, the entropy, the loss and every weight's gradient (the
gradient of the hidden states flows through the whole model) of both, and a flag saying whether
each pair is bit-identical. :func:`cp_parity`: the model at CP = ``cp`` (or CP = 1, the long-input
output) through the roles' path (``_packed_log_probs``) with chunks of a few tokens and with one
chunk (the logits materialized);
gradients summed over the CP group and divided by CP as in tests/helpers/context_parallel_checks.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LENGTHS = (7, 1, 3, 12, 2, 6)  # 31 tokens: one padding row under SP at TP = 2


def _batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (sum(LENGTHS),), generator=g)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    return ids, cu


def _model(path: str, tp: int, cp: int, sp: bool, dtype):
    import parallel_models as pm

    pm.init_parallel(tensor_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)
    family = "Qwen2" if "qwen2" in path else "Llama"
    cls = pm.get_model_class(f"{family}ForCausalLM", "causal_lm", True)
    return cls.from_pretrained(path, dtype=dtype)


def _grads(model, cp_group=None, cp: int = 1) -> dict:
    from parallel_models.utils.grads import allreduce_sequence_parallel_grads

    allreduce_sequence_parallel_grads(model)
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().float().clone()
        if cp > 1:
            dist.all_reduce(g, group=cp_group)
            g /= cp
        out[name] = g
    return out


def _weights(n: int):
    """Per-token loss weights of both signs (every gradient term matters)."""
    return torch.linspace(-0.5, 1.5, n)


def head_parity(path: str, tp: int, sp: bool, with_entropy: bool, chunk: int,
                bf16: bool = False) -> dict:
    """Both paths on the model's final hidden states at TP = ``tp``: ``{"chunked": ...,
    "plain": ..., "bitwise": {...}}``."""
    from parallel_models.utils.chunked_logprob import chunked_head_log_probs
    from parallel_models.utils.vocab_parallel import vocab_parallel_log_probs_and_entropy

    model = _model(path, tp, 1, sp, torch.bfloat16 if bf16 else torch.float32)
    ids, cu = _batch(model.config.vocab_size)
    head = model.lm_head

    def run(chunked: bool) -> dict:
        model.zero_grad(set_to_none=True)
        hidden, pad = model.forward_hidden(ids, cu)
        labels = torch.nn.functional.pad(torch.roll(ids, -1), (0, pad))
        weight = model.output_weight() if head.tied else None
        if chunked:
            logp, ent = chunked_head_log_probs(hidden, head, labels, weight=weight,
                                               with_entropy=with_entropy, temperature=0.9,
                                               chunk_tokens=chunk)
        else:
            logits = head(hidden, weight=weight).squeeze(1)
            logp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, temperature=0.9)
            ent = ent if with_entropy else None
        w = _weights(logp.shape[0])
        loss = -(logp * w).sum()
        if with_entropy:
            loss = loss + 0.1 * (ent * w.flip(0)).sum()
        loss.backward()
        return {"logp": logp.detach(), "entropy": None if ent is None else ent.detach(),
                "loss": loss.detach(), "grads": _grads(model)}

    plain, chunked = run(False), run(True)
    bitwise = {"logp": torch.equal(plain["logp"], chunked["logp"]),
               "grads": all(torch.equal(plain["grads"][k], chunked["grads"][k])
                            for k in plain["grads"])}
    return {"plain": plain, "chunked": chunked, "bitwise": bitwise, "tied": head.tied}


def cp_parity(path: str, tp: int, cp: int, sp: bool = False) -> dict:
    """The roles' log-prob path at CP = ``cp`` (1: the long-input output of
    ``heads/lm_output.py``) with chunks of 5 tokens and unchunked (one chunk: the logits made;
    at CP = 1 the eager head)."""
    from parallel_models.rl.roles.model_roles import _packed_log_probs
    from parallel_models.utils import chunked_logprob

    model = _model(path, tp, cp, sp, torch.float32)
    ids, cu = _batch(model.config.vocab_size)
    layout = model.parallel_layout

    def run(chunk_tokens: int) -> dict:
        saved = chunked_logprob.LOGITS_CHUNK_BYTES
        chunked_logprob.LOGITS_CHUNK_BYTES = 4 * model.lm_head.per_rank * chunk_tokens
        try:
            model.zero_grad(set_to_none=True)
            out = model(ids, cu)
            logp, ent = _packed_log_probs(out, {"input_ids": ids, "cu_seqlens": cu}, 0.9, True)
            w = _weights(logp.shape[0])
            loss = -(logp * w).sum() + 0.1 * (ent * w.flip(0)).sum()
            loss.backward()
        finally:
            chunked_logprob.LOGITS_CHUNK_BYTES = saved
        lazy = hasattr(out, "next_token_log_probs")
        made = True
        if lazy:
            made = (out._local_logits if cp > 1 else out._logits) is not None
        return {"logp": logp.detach(), "entropy": ent.detach(), "loss": loss.detach(),
                "grads": _grads(model, layout.cp_group, cp), "lazy": lazy, "logits_made": made,
                "local_tokens": out.cp_shard.input_ids.shape[0] if cp > 1 else ids.shape[0],
                "logits": out.logits.detach()}

    return {"plain": run(10 ** 6), "chunked": run(5)}
