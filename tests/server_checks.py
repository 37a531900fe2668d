"""Helpers for the rollout-server tests: in-process reference generation."""

from __future__ import annotations


import torch

EOS = 2  # the builtin tokenizer's </s>, which the server uses as eos by default


def reference_greedy(paths: list[str], prompts: list[list[int]], max_new_tokens: int) -> list:
    """For each model folder: greedy responses (token ids, log-probs) of each prompt generated
    alone, in-process (TP=1)."""
    import parallel_models as pm
    from parallel_models.llama.checkpoint_utils.loader import load_hf_weights
    from parallel_models.rl.rollout.generation import SamplingParams, generate

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(paths[0], rmpad=True, dtype=torch.float32)
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, eos_token_id=EOS)
    out = []
    for i, path in enumerate(paths):
        if i:
            load_hf_weights(model, path)
        per = []
        for p in prompts:
            g = generate(model, [p], params)
            n = int(g.response_mask[0].sum())
            per.append((g.responses[0, :n].tolist(), g.log_probs[0, :n].tolist()))
        out.append(per)
    return out




