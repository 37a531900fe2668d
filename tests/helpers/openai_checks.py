"""Worker for the OpenAI-API tests: generate's top-k log-probs at TP=N (gloo ranks) against a
transformers forward of the same weights."""

from __future__ import annotations

import os

import torch


def top_logprobs_vs_transformers(path: str, k: int, temperature: float) -> dict:
    """Sampled generation with ``top_logprobs=k`` at TP = the world size: the largest error of its top-k
    log-probs (and ids) against ``log_softmax(transformers logits / temperature)``, and whether
    every rank returned the same."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import parallel_models as pm
    from parallel_models.inference.generation import SamplingParams, generate

    pm.init_parallel(tensor_parallel_size=int(os.environ["WORLD_SIZE"]))
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    model.eval()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [[1, 20, 33, 7], [1, 9], [1, 40, 41, 42, 43, 44]]
    params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=5)
    out = generate(model, prompts, params, top_logprobs=k)
    plain = generate(model, prompts, params)  # same seed, no top-k: the same draws
    res = {"same_draws": torch.equal(out.responses, plain.responses) and plain.top_token_ids is None,
           "shape": tuple(out.top_token_ids.shape), "ids_mismatch": 0, "max_err": 0.0,
           "chosen_err": 0.0}
    for b, p in enumerate(prompts):
        n = int(out.response_mask[b].sum())
        ids = p + out.responses[b, :n].tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, len(p) - 1:len(p) - 1 + n].float()
        ref = torch.log_softmax(logits / temperature, -1)
        values, order = ref.topk(k, -1)
        res["ids_mismatch"] += int((order != out.top_token_ids[b, :n]).sum())
        res["max_err"] = max(res["max_err"],
                             (values - out.top_log_probs[b, :n]).abs().max().item())
        chosen = ref.gather(-1, out.responses[b, :n, None]).squeeze(-1)
        res["chosen_err"] = max(res["chosen_err"],
                                (chosen - out.log_probs[b, :n]).abs().max().item())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (out.top_token_ids.tolist(), out.top_log_probs.tolist()))
    res["ranks_agree"] = all(g == gathered[0] for g in gathered)
    return res
