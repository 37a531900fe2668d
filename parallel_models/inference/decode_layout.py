"""The continuous engine's decode batch: which entry of a bucket holds which row, and the rows'
draw settings (``continuous.ContinuousEngine``).

A decode step runs one token per entry. A running row is one entry (its last drawn token at
position ``length``), except a row *fed* in this step: a multi-turn conversation re-entering
after a tool with a few new tokens (``_Row.feed``: its last drawn id and the appended tool /
observation ids). Its new tokens become consecutive entries of the same region, at positions
``length .. length + t - 1``, and only the last one's logits draw the row's next token: the
re-entry costs no prefill call of its own (an eager launch that stalls every row), only ``t - 1``
extra entries in a step the other rows run anyway. An entry's ``back`` counts its row's entries
before it in the step, whose k / v it reads from the step's own new k / v
(``split_kv_attention``; the PyTorch paths write every entry's k / v into the pool before the
attention reads it, so they need nothing). A step holds at most the largest bucket's entries
(the engine's ``max_rows`` plus one largest re-entry's others): fed rows that do not fit wait
for a later step, in the order they joined, holding no entry (never a prefill instead: one
costs far more than a step's wait). A layout with fed rows serves one step only
(``transient``): the next one is built again.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(eq=False)
class DecodeLayout:
    """The running rows of a decode bucket, in batch order, and their draw settings. ``take``:
    the entries whose logits draw the rows' tokens (None: the first ``len(rows)``, one entry a
    row: no row fed); ``waiting``: some fed row did not fit this step."""

    rows: list
    size: int
    spec: list
    k_max: int
    seeds: torch.Tensor | None
    steps: torch.Tensor | None
    take: torch.Tensor | None = None
    waiting: bool = False

    @property
    def transient(self) -> bool:
        """Rows were fed or wait to be: the next step needs a layout of its own."""
        return self.take is not None or self.waiting


def sampling_of(rows: list, device):
    """(draw groups, top-k width, seeds, steps) of ``rows``: one group when they share their
    sampling knobs; seeds / steps only when some row samples (greedy draws no noise)."""
    groups: dict = {}
    for i, r in enumerate(rows):
        p = r.request.params
        key = (p.greedy, p.temperature, p.top_k, p.top_p) if not p.greedy else (True,)
        groups.setdefault(key, (p, []))[1].append(i)
    if len(groups) == 1:
        spec = [(None, next(iter(groups.values()))[0])]
    else:
        spec = [(torch.tensor(idx, device=device), p) for p, idx in groups.values()]
    seeds = steps = None
    if any(not p.greedy for _, p in spec):
        meta = torch.tensor([[r.seed for r in rows], [r.generated for r in rows]],
                            dtype=torch.long).to(device)
        seeds, steps = meta[0], meta[1].clone()
    return spec, max(r.request.top_logprobs for r in rows), seeds, steps


def build_layout(running: list, buckets: list[int], scratch, device) -> tuple[DecodeLayout,
                                                                              torch.Tensor, int]:
    """The layout of the ``running`` rows that fit (every unfed row, then fed ones in joining
    order while the largest bucket has room; sorted by region start) and its packed entries
    ``[4, size]`` (tokens, region starts, positions, back) on the host, padded to the smallest
    bucket that holds them (padding entry ``i`` at ``scratch(i)``), with the step's span (the
    longest entry's positions + 1). The feeds taken are consumed: those rows' lengths advance by
    all of it minus the one the caller adds after every step."""
    room = buckets[-1] - sum(1 for r in running if not r.feed)
    rows, fed, waiting = [], False, False
    for r in running:
        if r.feed:
            if waiting or len(r.feed) > room:  # a later step runs it (first come, first fed:
                waiting = True                 # the first waiting one always fits the next)
                continue
            room -= len(r.feed)
        rows.append(r)
    rows.sort(key=lambda r: r.offset)  # ascending region starts
    tokens, offsets, lengths, back, take = [], [], [], [], []
    for r in rows:
        feed = r.feed or [r.token]
        for j, tok in enumerate(feed):
            tokens.append(tok)
            offsets.append(r.offset)
            lengths.append(r.length + j)
            back.append(j)
        take.append(len(tokens) - 1)
        if r.feed:
            fed = True
            r.length += len(r.feed) - 1  # the caller adds the last one, as for any entry
            r.feed = None
    size = next(b for b in buckets if b >= len(tokens))
    pad = size - len(tokens)
    host = torch.tensor([tokens + [0] * pad,
                         offsets + [scratch(i) for i in range(pad)],
                         lengths + [0] * pad,
                         back + [0] * pad], dtype=torch.long)
    lay = DecodeLayout(rows, size, *sampling_of(rows, device),
                       take=torch.tensor(take, device=device) if fed else None, waiting=waiting)
    return lay, host, max(lengths) + 1


__all__ = ["DecodeLayout", "build_layout", "sampling_of"]
