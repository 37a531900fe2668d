"""What a causal LM's forward returns for packed tokens: the LM head's logits, or, where the
rank's ``[tokens, vocab/TP]`` logits would span more than one chunk of
``utils/chunked_logprob.py``, an output that runs the head only when asked.

:func:`causal_lm_head` is the model's head step (``ParallelModel._head`` for ``causal_lm``):

- under context parallelism: a ``ShardedCausalLMOutput`` (``parallel_models/context_parallel.py``);
- long inputs (more tokens than one chunk; not ``full_vocab``): a :class:`LazyCausalLMOutput`;
- otherwise the logits ``[tokens, vocab/TP]`` (``[tokens, vocab]`` with ``full_vocab``) as
  before, which the model wraps in its ``CausalLMOutput``.

Both output objects have ``logits`` (made on first read, the same values as the eager head's)
and ``next_token_log_probs(input_ids, cu_seqlens, with_entropy, temperature)``, the values of
``log_probs_from_packed_logits``: for long inputs through ``chunked_head_log_probs``, which never
holds the logits (the RL roles' log-prob path and ``bench/long_context.py`` call it).
"""

from __future__ import annotations

import torch

from parallel_models.utils.chunked_logprob import chunked_head_log_probs, worth_chunking
from parallel_models.utils.vocab_parallel import (log_probs_from_packed_logits,
                                                  packed_next_token_mask)


class LazyCausalLMOutput:
    """The final hidden states ``[tokens(+pad)(/tp), 1, H]`` and the vocab-parallel head of a
    packed batch whose last ``pad`` rows are padding (sequence parallelism)."""

    def __init__(self, hidden: torch.Tensor, lm_head, weight: torch.Tensor | None, pad: int):
        self.hidden, self.lm_head, self._weight, self._pad = hidden, lm_head, weight, pad
        self._logits = None

    @property
    def logits(self) -> torch.Tensor:
        """This rank's vocab-parallel logits of the real tokens ``[tokens, vocab/TP]``."""
        if self._logits is None:
            logits = self.lm_head(self.hidden, weight=self._weight).squeeze(1)
            self._logits = logits[: logits.shape[0] - self._pad]
        return self._logits

    def next_token_log_probs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                             with_entropy: bool = False, temperature: float = 1.0):
        """``log_probs_from_packed_logits(self.logits, input_ids, cu_seqlens, ...)`` without
        the logits (unless they were already made)."""
        if self._logits is not None:
            return log_probs_from_packed_logits(self._logits, input_ids, cu_seqlens,
                                                with_entropy=with_entropy,
                                                temperature=temperature)
        tokens = input_ids.shape[0]
        labels = torch.nn.functional.pad(torch.roll(input_ids, shifts=-1), (0, self._pad))
        logp, ent = chunked_head_log_probs(self.hidden, self.lm_head, labels, weight=self._weight,
                                           with_entropy=with_entropy, temperature=temperature)
        mask = packed_next_token_mask(cu_seqlens, tokens)
        logp = torch.where(mask, logp[:tokens], torch.zeros((), dtype=logp.dtype,
                                                            device=logp.device))
        return (logp, ent[:tokens]) if with_entropy else logp


def causal_lm_head(model, hidden: torch.Tensor, pad, full_vocab: bool):
    """``model``'s LM head on its final hidden states (``pad``: the padding row count, or the CP
    shard): the logits tensor or an output object (module docstring)."""
    head = model.lm_head
    weight = model.output_weight() if head.tied else None
    if not isinstance(pad, int):  # a ContextParallelShard: the head runs on first use
        from parallel_models.context_parallel import ShardedCausalLMOutput

        return ShardedCausalLMOutput(pad, hidden, head, weight,
                                     head.gather if full_vocab else None)
    rows = hidden.shape[0] * (model.tp if model.sequence_parallel else 1)
    if not full_vocab and worth_chunking(rows, head.per_rank):
        return LazyCausalLMOutput(hidden, head, weight, pad)
    logits = head(hidden, weight=weight).squeeze(1)  # [tokens(+pad), vocab/tp]; SP gathered
    if full_vocab:
        logits = head.gather(logits)
    return logits[: logits.shape[0] - pad]


__all__ = ["LazyCausalLMOutput", "causal_lm_head"]
