"""Generation with the fsdp actor itself, for model families our registry lacks (no parallel
CausalLM to fill): transformers' ``generate`` on the sharded model, with ``synced_gpus=True`` so
that every rank keeps running forwards (each all-gathers the layers) until all ranks have
finished their rows. Returns the rollout engine's :class:`GenerationOutput` (left-padded prompts,
right-padded responses with the stop token included).
"""

from __future__ import annotations

from typing import Sequence

import torch

from parallel_models.inference import GenerationOutput, SamplingParams


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
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams
                 ) -> GenerationOutput:
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
        was_training = self.model.training
        self.model.eval()
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            with torch.random.fork_rng(devices=cuda, enabled=params.seed is not None):
                if params.seed is not None:  # seeded draws of their own
                    torch.manual_seed(params.seed)
                out = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                    max_new_tokens=params.max_new_tokens, do_sample=not params.greedy,
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
