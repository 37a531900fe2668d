"""Worker for the generation tests: greedy vs transformers.generate, sampled log-probs vs a
fresh forward pass (run on gloo ranks)."""

from __future__ import annotations

import torch


def check_generation(path: str, tp: int, sp: bool) -> dict:
    import parallel_models as pm
    from transformers import AutoModelForCausalLM

    from parallel_models.inference.generation import SamplingParams, generate
    from parallel_models.utils.padding import pack_padded_batch, unpack_to_padded

    pm.init_parallel(tensor_parallel_size=tp, sequence_parallel=sp)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    res = {}
    greedy = generate(model, prompts, SamplingParams(max_new_tokens=12, greedy=True))
    mismatches = []
    for b, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, pad_token_id=0)
        if ref[0, len(p):].tolist() != greedy.responses[b].tolist():
            mismatches.append(b)
    res["greedy_mismatches"] = mismatches

    temp = 0.7
    torch.manual_seed(1)
    out = generate(model, prompts, SamplingParams(max_new_tokens=10, temperature=temp, top_k=50,
                                                   top_p=0.9, eos_token_id=[5, 6]))
    packed = pack_padded_batch(out.sequences, out.attention_mask)
    with torch.no_grad():
        logits = model(packed.input_ids, packed.cu_seqlens, full_vocab=True).logits.float() / temp
    logp = torch.log_softmax(unpack_to_padded(logits, packed), -1)
    P = out.prompts.shape[1]
    fresh = logp[:, P - 1:-1].gather(-1, out.responses[..., None]).squeeze(-1) * out.response_mask
    res["logp_err"] = (fresh - out.log_probs).abs().max().item()
    # after a stop token the response is masked and padded
    stops = torch.isin(out.responses, torch.tensor([5, 6])) & out.response_mask.bool()
    res["stop_ok"] = all(
        int(out.response_mask[b].sum()) == int(stops[b].nonzero()[0]) + 1
        for b in range(len(prompts)) if stops[b].any())
    res["responses"] = out.responses
    return res
