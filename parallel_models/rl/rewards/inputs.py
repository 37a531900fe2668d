"""The actor's batch as the reward model reads it: the valid token ids of every row, the split
into prompt and response, and where a sequence's score lands as a token-level reward.

Layouts (all of them: see ``parallel_models.rl.rewards.model``)
    Padded: ``sequences [N, L]`` (or 2-D ``input_ids``), ``attention_mask [N, L]``, and
    ``prompt_lengths [N]`` and/or ``response_mask`` (``[N, R]`` over the last ``R`` columns, or
    ``[N, L]`` over the whole row); the valid tokens of a row are its prompt (the first
    ``prompt_lengths`` valid tokens) followed by its response, so left-padded, right-padded and
    PPO (left-padded prompt + right-padded response) rows all work.
    Packed: ``input_ids [T]``, ``cu_seqlens [N+1]`` and ``prompt_lengths [N]`` or a packed
    ``response_mask [T]``.
A batch that does not fit raises a ``ValueError`` naming the key and the row.
"""

from __future__ import annotations

import torch

from parallel_models.rl.algorithms.core import scores_at_last_token

__all__ = ["valid_sequences", "split_prompt_response", "place_scores"]


def _is_packed(batch: dict) -> bool:
    """A packed batch: 1-D ``input_ids`` (with ``cu_seqlens``) and no ``sequences``."""
    ids = batch.get("input_ids")
    return "sequences" not in batch and ids is not None and ids.dim() == 1


def _padded_ids(batch: dict) -> torch.Tensor:
    seqs = batch.get("sequences", batch.get("input_ids"))
    if seqs is None or seqs.dim() != 2:
        raise ValueError("reward batch needs 'sequences' [N, L] (padded) or 'input_ids' [T] + "
                         f"'cu_seqlens' [N+1] (packed); got keys {sorted(batch)}")
    return seqs


def valid_sequences(batch: dict) -> list[list[int]]:
    """The valid token ids of every row (prompt + response, padding removed)."""
    if _is_packed(batch):
        ids = batch["input_ids"].tolist()
        cu = _cu_seqlens(batch)
        return [ids[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]
    seqs = _padded_ids(batch)
    mask = batch.get("attention_mask")
    mask = torch.ones_like(seqs, dtype=torch.bool) if mask is None else mask.bool()
    return [row[m].tolist() for row, m in zip(seqs.cpu(), mask.cpu())]


def _cu_seqlens(batch: dict) -> list[int]:
    if "cu_seqlens" not in batch:
        raise ValueError("a packed reward batch (1-D 'input_ids') needs 'cu_seqlens' [N+1]")
    cu = [int(x) for x in batch["cu_seqlens"].tolist()]
    if cu[0] != 0 or cu[-1] != batch["input_ids"].numel() or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu[:8]}... must rise from 0 to the token count "
                         f"{batch['input_ids'].numel()}")
    return cu


def _prompt_lengths(batch: dict, lengths: list[int]) -> list[int]:
    """Valid prompt tokens per row: ``prompt_lengths``, else derived from ``response_mask``."""
    n = len(lengths)
    pl = batch.get("prompt_lengths")
    resp = batch.get("response_mask")
    if pl is not None:
        out = [int(x) for x in torch.as_tensor(pl).reshape(-1).tolist()]
    elif resp is None:
        raise ValueError("cannot tell prompt from response: the batch needs 'prompt_lengths' or "
                         "'response_mask'")
    elif _is_packed(batch):
        cu = _cu_seqlens(batch)
        r = resp.reshape(-1).bool().cpu()
        out = [int((~r[cu[i]:cu[i + 1]]).sum()) for i in range(n)]
    else:
        seqs = _padded_ids(batch)
        mask = batch.get("attention_mask")
        mask = torch.ones_like(seqs, dtype=torch.bool) if mask is None else mask.bool()
        L, R = seqs.shape[1], resp.shape[1]
        if R == L:
            out = (mask & ~resp.bool()).sum(-1).tolist()
        else:
            out = mask[:, :L - R].sum(-1).tolist()
    if len(out) != n:
        raise ValueError(f"prompt_lengths has {len(out)} entries for {n} sequences")
    for i, (p, length) in enumerate(zip(out, lengths)):
        if not 0 <= p <= length:
            raise ValueError(f"row {i}: prompt_lengths={p} but the row has {length} valid tokens")
    return out


def _response_counts(batch: dict, n: int) -> list[int] | None:
    resp = batch.get("response_mask")
    if resp is None:
        return None
    if _is_packed(batch):
        cu = _cu_seqlens(batch)
        r = resp.reshape(-1).bool().cpu()
        return [int(r[cu[i]:cu[i + 1]].sum()) for i in range(n)]
    return [int(x) for x in resp.bool().sum(-1).tolist()]


def split_prompt_response(batch: dict) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) per row, in the actor's vocabulary, padding removed."""
    seqs = valid_sequences(batch)
    pls = _prompt_lengths(batch, [len(s) for s in seqs])
    counts = _response_counts(batch, len(seqs))
    prompts, responses = [], []
    for i, (s, p) in enumerate(zip(seqs, pls)):
        if counts is not None and len(s) - p != counts[i]:
            raise ValueError(f"row {i}: {len(s)} valid tokens - {p} prompt tokens != "
                             f"{counts[i]} response tokens in response_mask; the valid tokens of a "
                             "row must be its prompt followed by its response")
        prompts.append(s[:p])
        responses.append(s[p:])
    return prompts, responses


def place_scores(scores: torch.Tensor, batch: dict) -> torch.Tensor:
    """Token-level rewards: each sequence's score on its response's last valid token, zeros
    elsewhere (float32). Padded batches: shaped like ``response_mask`` (``[N, R]`` or ``[N, L]``,
    any padding side). Packed batches: ``[T]``, at the last ``response_mask`` token of each
    sequence, or (without a mask) its last token when it has a response (``prompt_lengths``).
    A row with an empty response gets no reward token (nothing to put it on)."""
    scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1)
    if _is_packed(batch):
        cu = _cu_seqlens(batch)
        n = len(cu) - 1
        if scores.numel() != n:
            raise ValueError(f"{scores.numel()} scores for {n} packed sequences")
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32,
                          device=batch["input_ids"].device)
        resp = batch.get("response_mask")
        if resp is not None:
            r = resp.reshape(-1).bool().cpu()
            for i in range(n):
                pos = torch.nonzero(r[cu[i]:cu[i + 1]]).flatten()
                if pos.numel():
                    out[cu[i] + int(pos[-1])] = scores[i]
            return out
        lengths = [cu[i + 1] - cu[i] for i in range(n)]
        pls = _prompt_lengths(batch, lengths) if "prompt_lengths" in batch else [0] * n
        for i in range(n):
            if lengths[i] > pls[i]:
                out[cu[i + 1] - 1] = scores[i]
        return out
    resp = batch.get("response_mask")
    if resp is None:
        raise ValueError("token-level rewards of a padded batch need its 'response_mask'")
    if scores.numel() != resp.shape[0]:
        raise ValueError(f"{scores.numel()} scores for {resp.shape[0]} rows")
    return scores_at_last_token(scores, resp)
