"""Generated token ids -> the text the OpenAI-compatible API returns: the text each token adds
(for streaming deltas and ``text_offset``), the cut at the first stop string (the one completed
first, as if generation had stopped there), token strings of the log-prob answers.

Token pieces are decoded incrementally over a short window (the method of text-generation-
inference): a piece is the text that decoding one more token adds to the decoding of the tokens
before it (from the same window start, so tokenizers that drop the leading space of a sequence
agree with themselves); a token that ends in an incomplete character (``"\\ufffd"``) adds nothing
until the character completes. Special tokens (EOS) add no text.
"""

from __future__ import annotations

import dataclasses


class IncrementalDetokenizer:
    """Token ids in, the text each one adds out (empty while a character is incomplete)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def _decode(self, part) -> str:
        return self.tokenizer.decode(part, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        now = self._decode(self.ids[self.prefix_offset:])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return now[len(before):]
        return ""


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each of ``ids`` adds; ``"".join`` of them is ``tokenizer.decode(ids,
    skip_special_tokens=True)`` (the tail is fixed up to it where a tokenizer disagrees)."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    joined = "".join(pieces)
    if full != joined and pieces:
        if full.startswith(joined):
            pieces[-1] += full[len(joined):]
        else:  # a tokenizer whose incremental decoding disagrees: one piece for it all
            pieces = [""] * (len(ids) - 1) + [full]
    return pieces


@dataclasses.dataclass
class FinishedText:
    """One sample as the API returns it: ``pieces`` (per kept token, the last one cut at the
    stop string), ``text`` = their concatenation, ``n_tokens`` tokens kept (counted in usage)."""

    text: str
    pieces: list[str]
    n_tokens: int
    finish_reason: str


def finish_text(tokenizer, token_ids: list[int], finish_reason: str,
                stop_strings: list[str]) -> FinishedText:
    """Decode a sample and cut it before the first stop string (then ``finish_reason`` is
    ``"stop"`` and the tokens after the one that completed it are dropped)."""
    pieces = token_pieces(tokenizer, token_ids)
    text = "".join(pieces)
    cut = first_stop(text, stop_strings)
    if cut is None:
        return FinishedText(text, pieces, len(token_ids), finish_reason)
    start, end = cut
    kept, seen = [], 0
    for piece in pieces:  # keep the tokens up to the one that completes the stop string
        kept.append(piece)
        seen += len(piece)
        if seen >= end:
            break
    # trim the kept pieces to end where the stop string starts
    out, seen = [], 0
    for piece in kept:
        room = max(0, start - seen)
        out.append(piece[:room])
        seen += len(piece)
    return FinishedText(text[:start], out, len(kept), "stop")


def first_stop(text: str, stop_strings: list[str]) -> tuple[int, int] | None:
    """(start, end) of the stop string occurrence in ``text`` that is completed first (ties:
    the one starting first), or None."""
    best = None
    for s in stop_strings:
        at = text.find(s)
        if at >= 0 and (best is None or (at + len(s), at) < (best[1], best[0])):
            best = (at, at + len(s))
    return best


def held_back(text: str, stop_strings: list[str]) -> int:
    """How many characters at the end of ``text`` may still become the start of a stop string
    (a stream must not send them yet)."""
    longest = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def single_token_stops(tokenizer, stop_strings: list[str], vocab_size: int) -> list[int]:
    """Token ids that are exactly one of ``stop_strings``: generation can end at them (the text
    cut happens in :func:`finish_text` either way; longer stop strings are found there)."""
    ids = []
    for s in stop_strings:
        enc = tokenizer(s, add_special_tokens=False)["input_ids"]
        if len(enc) == 1 and 0 <= enc[0] < vocab_size and tokenizer.decode(enc) == s:
            ids.append(int(enc[0]))
    return sorted(set(ids))


def token_string(tokenizer, token_id: int) -> str:
    """How a token is named in the log-prob answers (special tokens by their text)."""
    return tokenizer.decode([token_id])


__all__ = ["FinishedText", "IncrementalDetokenizer", "finish_text", "first_stop", "held_back",
           "single_token_stops", "token_pieces", "token_string"]
