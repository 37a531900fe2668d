"""The continuous engine on a tiny model through a chosen decode attention (``aten``: masked
SDPA over the pool on the CPU; ``triton``: the split-KV kernel, in the interpreter), shared by
the split-KV kernel's tests of the model-dtype and the FP8 KV pool."""

from __future__ import annotations

import torch


def tiny_model_and_prompts(path: str):
    """(the RmPad model of ``path`` in fp32, three prompts of 3 / 9 / 14 tokens, greedy sampling
    of 6 new tokens), TP=1 in this process."""
    import parallel_models as pm
    from parallel_models.inference.sampling import SamplingParams

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 9, 14)]
    return model, prompts, SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=6)


def staggered_run(model, prompts, params, kernel: str, **engine_kwargs) -> tuple[list, object]:
    """Each prompt submitted a step after the one before (rows join a running batch) to an
    engine whose decode attention is ``kernel``; -> ([(token ids, log-probs)] per prompt, the
    engine)."""
    from parallel_models.inference.continuous import ContinuousEngine

    eng = ContinuousEngine(model, 120, max_rows=4, max_row_tokens=40, **engine_kwargs)
    eng.cache.decode_kernel = kernel
    reqs = []
    for p in prompts:
        reqs.append(eng.submit(p, params))
        eng.step()
    eng.run()
    return [(r.samples[0].token_ids, r.samples[0].log_probs) for r in reqs], eng


__all__ = ["staggered_run", "tiny_model_and_prompts"]
