"""Workers for tests/distributed/test_context_parallel.py: one packed batch of uneven sequences
(some shorter than 2 x CP) through the same checkpoint at CP = 1 and at CP > 1 (same TP, SP), in
the same gloo ranks; returns both runs' logits (full vocab), loss, and gradients (this rank's TP
shard of every weight) for the test to compare.

The loss is the sum of the next-token log-probs of the vocab-parallel path
(``log_probs_from_packed_logits``) plus a weighted sum of the values; under CP every CP rank
computes it on the gathered outputs, and its gradients (CP x this rank's share, see
``parallel_models/context_parallel.py``) are summed over the CP group and divided by CP, which is
what megatron's DDP and per-token loss scaling do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LENGTHS = (7, 1, 3, 12, 2, 5)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (sum(LENGTHS),), generator=g)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    return ids, cu


def _run(path: str, head: str, tp: int, cp: int, sp: bool) -> dict:
    import parallel_models as pm
    from parallel_models.utils.grads import allreduce_sequence_parallel_grads
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    pm.init_parallel(tensor_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)
    family = "Qwen2" if "qwen2" in path else "Llama"
    cls = pm.get_model_class(f"{family}ForCausalLM", head, True)
    model = cls.from_pretrained(path, dtype=torch.float32)
    ids, cu = _batch(model.config.vocab_size)
    if head == "causal_lm":
        logits = model(ids, cu).logits
        logp = log_probs_from_packed_logits(logits, ids, cu,
                                            group=model.parallel_layout.tp_group)
        loss = -logp.sum()
        output = model.lm_head.gather(logits.detach())
    else:
        output = model(ids, cu).values
        weights = torch.linspace(-1.0, 2.0, output.shape[0])
        loss = (output * weights).sum()
        output = output.detach()
    loss.backward()
    allreduce_sequence_parallel_grads(model)
    layout = model.parallel_layout
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if cp > 1:
            dist.all_reduce(g, group=layout.cp_group)
            g /= cp
        grads[name] = g
    return {"output": output, "loss": loss.detach(), "grads": grads, "layout": repr(layout)}


def parity(path: str, head: str, tp: int, cp: int, sp: bool) -> dict:
    """The CP = 1 and CP = ``cp`` runs (both at ``tp``) on this rank."""
    reference = _run(path, head, tp, 1, sp)
    got = _run(path, head, tp, cp, sp)
    return {"reference": reference, "got": got}


def bad_world(cp: int) -> str:
    import parallel_models as pm

    try:
        pm.init_parallel(context_parallel_size=cp)
    except ValueError as e:
        return str(e)
    return "no error"


def reward_scores(path: str, cp: int) -> torch.Tensor:
    """The reward model's scores (``RewardModel.score_ids``, its packed forward through the
    pipeline schedule) of a few sequences of uneven lengths at CP = ``cp``."""
    import parallel_models as pm
    from parallel_models.rl.rewards.model import RewardModel
    from parallel_models.tokenizer import build_builtin_tokenizer

    pm.init_parallel(context_parallel_size=cp)
    rm = RewardModel(path, actor_tokenizer=build_builtin_tokenizer(), same_tokenizer=True,
                     dtype=torch.float32, offload=False, micro_batch_tokens=16)
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, rm.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    return rm.score_ids(ids)
