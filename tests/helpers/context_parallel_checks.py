"""Workers for tests/distributed/test_context_parallel.py: one packed batch of uneven sequences
(some shorter than 2 x CP) through the same checkpoint at CP = 1 and at CP > 1 (same TP, SP), in
the same gloo ranks; returns both runs' logits (full vocab), loss, and gradients (this rank's TP
shard of every weight) for the test to compare.

The loss is minus the next-token log-probs plus 0.1 x the entropy (the roles' path, which under
CP computes them on this rank's logits and gathers them), or a weighted sum of the values; every
CP rank computes it on the gathered per-token outputs, and its gradients (CP x this rank's share, see
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
    from parallel_models.rl.roles.model_roles import _packed_log_probs
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    pm.init_parallel(tensor_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)
    family = "Qwen2" if "qwen2" in path else "Llama"
    cls = pm.get_model_class(f"{family}ForCausalLM", head, True)
    model = cls.from_pretrained(path, dtype=torch.float32)
    ids, cu = _batch(model.config.vocab_size)
    if head == "causal_lm":
        out = model(ids, cu)
        # the roles' path: under CP on this rank's shard of the logits, then gathered
        logp, ent = _packed_log_probs(out, {"input_ids": ids, "cu_seqlens": cu}, 0.9, True)
        loss = -logp.sum() + 0.1 * ent.sum()
        # the gathered logits (CP: .logits) through the vocab-parallel path give the same
        check = log_probs_from_packed_logits(out.logits, ids, cu, temperature=0.9)
        output = model.lm_head.gather(out.logits.detach())
        extra = {"logp": logp.detach(), "entropy": ent.detach(), "logp_gathered": check.detach()}
    else:
        output = model(ids, cu).values
        weights = torch.linspace(-1.0, 2.0, output.shape[0])
        loss = (output * weights).sum()
        output = output.detach()
        extra = {}
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
    return {"output": output, "loss": loss.detach(), "grads": grads, "layout": repr(layout),
            **extra}


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


def moe_logits(path: str, ep: int, cp: int) -> torch.Tensor:
    """Full-vocab logits of the packed batch through an MoE checkpoint at EP = ``ep`` and
    CP = ``cp`` (megatron-core's MoE layer dispatching each CP rank's own tokens)."""
    import parallel_models as pm

    pm.init_parallel(expert_model_parallel_size=ep, context_parallel_size=cp)
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", True)
    model = cls.from_pretrained(path, dtype=torch.float32)
    ids, cu = _batch(model.config.vocab_size)
    with torch.no_grad():
        return model(ids, cu, full_vocab=True).logits


def recompute_grads(path: str, cp: int) -> dict:
    """``schedule_grads`` at CP = ``cp`` once per recompute mode (none, selective, full), with
    the calls of the CP attention counted (selective runs it again in the backward)."""
    from parallel_models.llama.layers import recompute

    real, calls, out = recompute.context_parallel_attention, [0], {}

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    recompute.context_parallel_attention = counted
    try:
        for mode in ("none", "selective", "full"):
            calls[0] = 0
            out[mode] = {"grads": schedule_grads(path, 1, cp, recompute=mode),
                         "recomputed_attention_calls": calls[0]}
    finally:
        recompute.context_parallel_attention = real
    return out


def schedule_grads(path: str, tp: int, cp: int, recompute: str = "none", ep: int = 1) -> dict:
    """Gradients of a token-mean next-token loss through ``pipeline.forward_backward`` (the
    plain finalize, no DDP) on two microbatches of the packed batch at TP = ``tp``, CP = ``cp``:
    the schedule's own CP reduction, nothing added here. ``recompute``: the model's recompute
    mode; ``ep``: expert-parallel size (MoE)."""
    import parallel_models as pm
    from parallel_models import pipeline
    from parallel_models.utils.vocab_parallel import log_probs_from_packed_logits

    from parallel_models.llama.layers.recompute import set_recompute

    pm.init_parallel(tensor_parallel_size=tp, context_parallel_size=cp,
                     expert_model_parallel_size=ep)
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", True)
    model = cls.from_pretrained(path, dtype=torch.float32)
    set_recompute(model, recompute)
    ids, cu = _batch(model.config.vocab_size)
    half = int(cu[3])
    mbs = [{"input_ids": ids[:half], "cu_seqlens": cu[:4]},
           {"input_ids": ids[half:], "cu_seqlens": cu[3:] - half}]

    def loss_fn(out, mb):
        logp = log_probs_from_packed_logits(out.logits, mb["input_ids"], mb["cu_seqlens"])
        return -logp.sum(), torch.tensor(logp.numel(), dtype=torch.int), {}

    pipeline.forward_backward([model], mbs, loss_fn)
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}
