"""Worker for tests/models/test_vocab_parallel.py: every TP=2 check of parallel_models.utils.vocab_parallel
in one spawned run. Returns ``{check name: relative error}`` (plus a few flags) as plain floats.

Each rank builds the same full-vocab logits from a fixed seed, keeps its vocab slice (padding rows
on the last rank set to ``finfo(dtype).min``, as the LM head does), runs the vocab-parallel
functions, and compares values and gradients with ``torch.log_softmax`` / entropy on the logits
all-gathered over the TP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _shard(full: torch.Tensor, vocab: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's slice of ``full [..., vocab]`` padded to a multiple of tp with finfo.min."""
    per_rank = -(-vocab // tp)
    padded = torch.full((*full.shape[:-1], per_rank * tp), torch.finfo(full.dtype).min,
                        dtype=full.dtype)
    padded[..., :vocab] = full
    return padded[..., rank * per_rank:(rank + 1) * per_rank].clone()


def _gather_vocab(local: torch.Tensor, vocab: int, group) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :vocab]


def _reference(full: torch.Tensor, labels, g_lp, g_ent):
    """Full-vocab float32 log-probs, entropy and d(sum g_lp*lp + g_ent*H)/dlogits."""
    z = full.detach().float().requires_grad_()
    logp_all = torch.log_softmax(z, dim=-1)
    lp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), z.grad


def _grad_slice(full_grad: torch.Tensor, local_vocab: int, rank: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(full_grad, (0, local_vocab * 2 - full_grad.shape[-1]))
    return padded[..., rank * local_vocab:(rank + 1) * local_vocab]


def _dense_case(out: dict, tag: str, vocab: int, dtype, group, rank: int, seed: int) -> None:
    from parallel_models.utils.vocab_parallel import (vocab_parallel_entropy,
                                                      vocab_parallel_log_probs,
                                                      vocab_parallel_log_probs_and_entropy)

    g = torch.Generator().manual_seed(seed)
    shape = (3, 7)
    full = (torch.randn(*shape, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    # make sure labels land on both ranks' slices and at the slice edges
    per_rank = -(-vocab // 2)
    labels[0, :4] = torch.tensor([0, per_rank - 1, per_rank, vocab - 1])
    g_lp, g_ent = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)

    local = _shard(full, vocab, 2, rank)
    gathered = _gather_vocab(local, vocab, group)
    out[f"{tag}/gathered_matches_full"] = max_rel_error(gathered.float(), full.float())
    lp_ref, ent_ref, grad_ref = _reference(gathered, labels, g_lp, g_ent)
    grad_ref_local = _grad_slice(grad_ref, local.shape[-1], rank)
    _, _, grad_lp_only = _reference(gathered, labels, g_lp, torch.zeros_like(g_ent))
    _, _, grad_ent_only = _reference(gathered, labels, torch.zeros_like(g_lp), g_ent)

    # combined
    x = local.clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs_and_entropy(x, labels)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    out[f"{tag}/both/logp"] = max_rel_error(lp, lp_ref)
    out[f"{tag}/both/entropy"] = max_rel_error(ent, ent_ref)
    out[f"{tag}/both/grad"] = max_rel_error(x.grad.float(), grad_ref_local)
    out[f"{tag}/dtypes_ok"] = float(lp.dtype == ent.dtype == torch.float32
                                    and x.grad.dtype == dtype)

    # log-probs only
    x = local.clone().requires_grad_()
    lp = vocab_parallel_log_probs(x, labels, group=group)  # explicit group
    (lp * g_lp).sum().backward()
    out[f"{tag}/logp/value"] = max_rel_error(lp, lp_ref)
    out[f"{tag}/logp/grad"] = max_rel_error(x.grad.float(), _grad_slice(grad_lp_only, local.shape[-1], rank))

    # entropy only
    x = local.clone().requires_grad_()
    ent = vocab_parallel_entropy(x)
    (ent * g_ent).sum().backward()
    out[f"{tag}/entropy/value"] = max_rel_error(ent, ent_ref)
    out[f"{tag}/entropy/grad"] = max_rel_error(x.grad.float(),
                                      _grad_slice(grad_ent_only, local.shape[-1], rank))
    if vocab % 2:  # the padding row (last rank) must get exactly zero gradient
        out[f"{tag}/pad_grad_abs"] = float(x.grad[..., vocab - rank * per_rank:].abs().max()) \
            if rank == 1 else 0.0


def _packed_case(out: dict, group, rank: int) -> None:
    from parallel_models.utils.vocab_parallel import gather_response, log_probs_from_packed_logits

    vocab = 257
    g = torch.Generator().manual_seed(7)
    lengths = [6, 1, 0, 9, 4]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    total = int(cu[-1])
    full = torch.randn(total, vocab, generator=g) * 2
    ids = torch.randint(0, vocab, (total,), generator=g)
    weight = torch.randn(total, generator=g)
    local = _shard(full, vocab, 2, rank)

    x = local.clone().requires_grad_()
    lp, ent = log_probs_from_packed_logits(x, ids, cu, with_entropy=True)
    ((lp * weight).sum() + ent.sum()).backward()

    # loop reference on the full logits, one sequence at a time
    z = full.clone().requires_grad_()
    ref_lp = torch.zeros(total)
    ref_ent = torch.zeros(total)
    terms = []
    for b in range(len(lengths)):
        start, end = int(cu[b]), int(cu[b + 1])
        for t in range(start, end):
            logp_all = torch.log_softmax(z[t], dim=-1)
            h = -(logp_all.exp() * logp_all).sum()
            ref_ent[t] = h.detach()
            terms.append(h)
            if t + 1 < end:
                ref_lp[t] = logp_all[ids[t + 1]].detach()
                terms.append(logp_all[ids[t + 1]] * weight[t])
    torch.stack(terms).sum().backward()
    out["packed/logp"] = max_rel_error(lp, ref_lp)
    out["packed/entropy"] = max_rel_error(ent, ref_ent)
    out["packed/grad"] = max_rel_error(x.grad, _grad_slice(z.grad, local.shape[-1], rank))
    ends = (cu[1:] - 1)[torch.tensor(lengths) > 0].long()
    out["packed/last_token_zero"] = float(lp[ends].abs().max())

    # end to end: packed prompt+response -> padded [B, R] response log-probs
    lengths = [6, 4, 9]
    prompts = [3, 2, 4]
    resp_len = 5
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    total = int(cu[-1])
    full = torch.randn(total, vocab, generator=g)
    ids = torch.randint(0, vocab, (total,), generator=g)
    local = _shard(full, vocab, 2, rank)
    lp = log_probs_from_packed_logits(local, ids, cu)
    resp = gather_response(lp, cu, torch.tensor(prompts), resp_len)
    ref = torch.zeros(len(lengths), resp_len)
    for b, (n, p) in enumerate(zip(lengths, prompts)):
        start = int(cu[b])
        for j in range(n - p):
            tok = start + p + j  # response token j; predicted by the logits at tok - 1
            ref[b, j] = torch.log_softmax(full[tok - 1], dim=-1)[ids[tok]]
    out["response/logp"] = max_rel_error(resp, ref)


def _lm_head_case(out: dict, group, rank: int) -> None:
    """The real ParallelLMHead (vocab 257 at TP=2, padding row) feeding the vocab-parallel
    log-probs: values and the gradient w.r.t. the hidden states match the gathered logits."""
    from megatron.core import ModelParallelConfig

    from parallel_models.heads.lm_head import ParallelLMHead
    from parallel_models.utils.vocab_parallel import vocab_parallel_log_probs_and_entropy

    torch.manual_seed(0)  # each rank initializes its own vocab rows; the reference uses the same
    mp = ModelParallelConfig(tensor_model_parallel_size=2, params_dtype=torch.float32,
                             use_cpu_initialization=True, perform_initialization=True)
    head = ParallelLMHead(16, 257, 258, mp_config=mp, tied=False, init_std=0.5)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(11, 1, 16, generator=g)
    labels = torch.randint(0, 257, (11,), generator=g)

    h1 = hidden.clone().requires_grad_()
    local = head(h1).squeeze(1)
    lp, ent = vocab_parallel_log_probs_and_entropy(local, labels)
    (lp.sum() + 0.5 * ent.sum()).backward()

    h2 = hidden.clone().requires_grad_()
    full = head.gather(head(h2)).squeeze(1)  # differentiable all-gather, padding cut
    logp_all = torch.log_softmax(full, dim=-1)
    ref_lp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    out["lm_head/logp"] = max_rel_error(lp, ref_lp)
    out["lm_head/entropy"] = max_rel_error(ent, ref_ent)
    # the hidden grad is a partial sum per rank (the head's input all-reduce happens upstream);
    # sum over ranks before comparing
    gh1, gh2 = h1.grad.clone(), h2.grad.clone()
    dist.all_reduce(gh1, group=group)
    dist.all_reduce(gh2, group=group)
    out["lm_head/hidden_grad"] = max_rel_error(gh1, gh2)


def run_all_checks() -> dict:
    import parallel_models as pm
    from megatron.core import parallel_state as mpu

    pm.init_parallel(tensor_parallel_size=2)
    group = mpu.get_tensor_model_parallel_group()
    rank = mpu.get_tensor_model_parallel_rank()
    out: dict = {}
    _dense_case(out, "fp32", 64, torch.float32, group, rank, seed=1)
    _dense_case(out, "bf16", 64, torch.bfloat16, group, rank, seed=2)
    _dense_case(out, "padded_fp32", 257, torch.float32, group, rank, seed=3)
    _dense_case(out, "padded_bf16", 257, torch.bfloat16, group, rank, seed=4)
    _packed_case(out, group, rank)
    _lm_head_case(out, group, rank)
    return out
