"""Partial rollouts (the server's ``--partial-rollouts``): a weight update lands between two
decode steps of the continuous engine instead of after the running rows finish. The rows in
flight go on under the new weights: before the update the step queued ahead (the decode
pipeline) is read, so its tokens count as drawn by the old weights; after it every running row's
KV cache (prompt + tokens so far) is computed again by the new weights, so each later token is
drawn, and its log-prob computed, exactly as a full forward of the new weights over the sample's
prefix would (:func:`recompute_running_kv`). Each generated token records the weight version
that drew it (``TokenVersions``; ``weight_versions`` per sample in ``/generate``'s answer).
"""

from __future__ import annotations

import torch

from parallel_models.inference.generation import sequence_parallel_off


def read_queued_step(engine) -> None:
    """Hand the tokens of the decode step queued ahead (if any) to their samples now."""
    if engine is not None and engine._pending is not None:
        pending, engine._pending = engine._pending, None
        engine._accept(pending)


@torch.no_grad()
def recompute_running_kv(engine) -> int:
    """Every running row's KV positions (its prompt and the tokens it has fed) again with the
    engine's current weights, in prefill packs; the decode buffers are rebuilt next step.
    Returns the rows refilled."""
    rows = sorted(engine.running, key=lambda r: r.offset)
    if not rows:
        return 0
    device, cache = engine.device, engine.cache
    packs, tokens = [], 0
    for r in rows:
        if not packs or tokens + r.length > engine.max_prefill_tokens:
            packs.append([])
            tokens = 0
        packs[-1].append(r)
        tokens += r.length
    with sequence_parallel_off(engine.model):
        for pack in packs:
            seqs = []
            for r in pack:
                fed = r.request.samples[r.index].token_ids[:-1]  # the last one is fed next
                seq = list(r.request.prompt) + list(fed)
                if r.feed:  # a re-entry waiting for its decode step: its kept positions only
                    seq = seq[:r.length]
                if len(seq) != r.length:
                    raise RuntimeError(f"row at {r.offset}: {len(seq)} tokens fed, the cache "
                                       f"holds {r.length}")
                seqs.append(seq)
            lengths = torch.tensor([len(s) for s in seqs], device=device)
            cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
            positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])
            offsets = torch.tensor([r.offset for r in pack], device=device)
            cache.begin_prefill(offsets, cu)
            engine.model.forward_hidden(ids, cu, positions, max(map(len, seqs)), kv_cache=cache)
            cache.end_step()
    engine._layout = None
    return len(rows)


class TokenVersions:
    """Per sample of a request, the weight version of each of its tokens (``record`` is the
    request's ``on_token`` hook; ``version()`` reads the engine's version at that moment)."""

    def __init__(self, samples: int, version, on_token=None):
        self.versions = [[] for _ in range(samples)]
        self.version, self.on_token = version, on_token

    def record(self, index, token, logp, top):
        self.versions[index].append(self.version())
        if self.on_token is not None:
            self.on_token(index, token, logp, top)


__all__ = ["TokenVersions", "read_queued_step", "recompute_running_kv"]
