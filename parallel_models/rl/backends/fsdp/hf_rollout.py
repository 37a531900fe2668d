"""Generation with the fsdp actor itself, for model families our registry lacks (no parallel
CausalLM to fill): transformers' ``generate`` on the sharded model, with ``synced_gpus=True`` so
that every rank keeps running forwards (each all-gathers the layers) until all ranks have
finished their rows. Returns the rollout engine's :class:`GenerationOutput` (left-padded prompts,
right-padded responses with the stop token included). With the trainer's prompt seeds it decodes
greedily over seeded noisy logits (``seeded_noise_logits``, a logits processor): the samples our
engine draws, whatever the rank or batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from transformers import LogitsProcessor, LogitsProcessorList

from parallel_models.inference import (GenerationOutput, SamplingParams, row_seed,
                                       seeded_noise_logits)


class _RowNoise(LogitsProcessor):
    """transformers' scores -> :func:`seeded_noise_logits` of each row's seed at the current step
    (``generate`` then picks the argmax: the seeded draw)."""

    def __init__(self, seeds: list[int], params: SamplingParams, prompt_width: int):
        self.seeds = torch.tensor(seeds, dtype=torch.long)
        self.params, self.prompt_width = params, prompt_width

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_width
        return seeded_noise_logits(scores, self.params, self.seeds.to(scores.device), step)


class HFRolloutEngine:
    """``generate(prompts, params)`` like ``parallel_models.inference.RolloutEngine`` over an HF model."""

    def __init__(self, model, *, eos_token_id=None, pad_token_id: int = 0):
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.generated_tokens = 0

    @property
    def device(self) -> torch.device:
        from parallel_models.rl.backends.fsdp.models import compute_device

        return compute_device()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_seeds: Sequence[int] | None = None) -> GenerationOutput:
        """``params.n`` samples of each prompt (rows prompt-major). ``prompt_seeds``: one seed
        per prompt; sample j then draws with the noise of ``row_seed(seed, j)`` (greedy decoding
        over :func:`seeded_noise_logits`), the tokens our engine draws from the same logits."""
        rows = [list(p) for p in prompts for _ in range(params.n)]
        P = max(len(r) for r in rows)
        ids = torch.full((len(rows), P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), P, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, P - len(r):] = torch.tensor(r)
            mask[i, P - len(r):] = 1
        stop = params.stop_ids(self.eos_token_id)
        # top_k=0 turns transformers' default top-k (50) off, as ours means "off"
        sample = {} if params.greedy else dict(temperature=params.temperature,
                                                top_k=params.top_k, top_p=params.top_p)
        if prompt_seeds is not None and not params.greedy:  # seeded rows: argmax of noisy logits
            seeds = [row_seed(int(s), j) for s in prompt_seeds for j in range(params.n)]
            sample = {"logits_processor": LogitsProcessorList([_RowNoise(seeds, params, P)])}
        was_training = self.model.training
        self.model.eval()
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.random.fork_rng(devices=cuda, enabled=params.seed is not None):
                if params.seed is not None:  # seeded draws of their own
                    torch.manual_seed(params.seed)
                out = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                    max_new_tokens=params.max_new_tokens,
                    do_sample=not params.greedy and "logits_processor" not in sample,
                    eos_token_id=stop or None, pad_token_id=self.pad_token_id,
                    synced_gpus=True, **sample).cpu()
        finally:
            self.model.train(was_training)
        responses = out[:, P:]
        response_mask = torch.ones_like(responses)
        if stop:
            hit = torch.isin(responses, torch.tensor(stop))
            after = (hit.long().cumsum(-1) - hit.long()) > 0  # past the first stop token
            response_mask = (~after).long()
        responses = torch.where(response_mask.bool(), responses, self.pad_token_id)
        self.generated_tokens += int(response_mask.sum())
        return GenerationOutput(prompts=ids, prompt_mask=mask, responses=responses,
                                response_mask=response_mask,
                                log_probs=torch.zeros(responses.shape, dtype=torch.float32))
