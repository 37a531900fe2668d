"""Rank functions of tests/test_exact_mode.py (run in a gloo process, fp32, the Triton
interpreter): a continuous-batching rollout under exact mode and the actor's log-prob forward
over the same tokens in microbatches of several sizes; the update's forward with autograd."""

from __future__ import annotations

import torch


def _rollout(model, prompts, max_new_tokens):
    from parallel_models.rl.rollout.continuous import ContinuousEngine, generation_output
    from parallel_models.rl.rollout.sampling import SamplingParams

    engine = ContinuousEngine(model, 256, max_rows=4)
    reqs = []
    for i, p in enumerate(prompts):  # one arrival per step: the decode batch changes
        params = SamplingParams(temperature=0.9, ignore_eos=True, n=1 + i % 2, seed=3 + i,
                                max_new_tokens=max_new_tokens - i % 3)
        reqs.append(engine.submit(p, params))
        engine.step()
    engine.run()
    return generation_output(reqs)


def check_rollout_vs_training(path: str, prompt_count: int, max_new_tokens: int) -> dict:
    import parallel_models as pm
    from parallel_models.llama.layers.exact import exact_mode
    from parallel_models.rl.roles import PolicyRole, _response_log_probs, make_microbatches

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 12, (prompt_count,), generator=g)]
    result = {}
    with exact_mode():
        out = _rollout(model, prompts, max_new_tokens)
        batch = dict(sequences=out.sequences, attention_mask=out.attention_mask,
                     prompt_lengths=out.prompt_mask.sum(-1), response_mask=out.response_mask)
        mask = out.response_mask.bool()
        rollout = out.log_probs[mask]
        result["tokens"] = int(mask.sum())
        result["exact_diff"] = {}
        for budget in (16, 10_000):  # one sequence per microbatch, all of them in one
            logp = PolicyRole(model, None, temperature=0.9, max_tokens=budget).log_probs(batch)
            result["exact_diff"][budget] = (None if torch.equal(logp[mask], rollout) else
                                            (logp[mask] - rollout).abs().max().item())
        # the update's forward, autograd on: the same bits, and gradients
        mb = make_microbatches(batch, 10_000)[0][0]
        logits = model(mb["input_ids"], mb["cu_seqlens"], mb["position_ids"],
                       mb["max_seqlen"]).logits
        logp, _ = _response_log_probs(logits, mb, 0.9, True)
        result["update_equal"] = torch.equal(logp[mask], rollout)
        logp[mask].sum().backward()
        exact_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    logits = model(mb["input_ids"], mb["cu_seqlens"], mb["position_ids"], mb["max_seqlen"]).logits
    logp, _ = _response_log_probs(logits, mb, 0.9, True)
    logp[mask].sum().backward()
    result["grad_rel_err"] = max(((a - p.grad).norm() / (p.grad.norm() + 1e-12)).item()
                                 for a, p in zip(exact_grads, model.parameters()))
    result["normal_diff"] = (logp.detach()[mask] - rollout).abs().max().item()
    return result
