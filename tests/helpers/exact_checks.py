"""Rank functions of tests/rl/test_exact_mode.py (a gloo process, fp32, the Triton interpreter) and
of tests/gpu/test_exact_mode.py's TP=2 case (nccl, bf16): a continuous-batching rollout under
exact mode and the actor's log-prob forward over the same tokens in microbatches of several
sizes; the update's forward with autograd."""

from __future__ import annotations

import torch


def _rollout(model, prompts, max_new_tokens):
    from parallel_models.inference.continuous import ContinuousEngine, generation_output
    from parallel_models.inference.sampling import SamplingParams

    engine = ContinuousEngine(model, 256, max_rows=4)
    reqs = []
    for i, p in enumerate(prompts):  # one arrival per step: the decode batch changes
        params = SamplingParams(temperature=0.9, ignore_eos=True, n=1 + i % 2, seed=3 + i,
                                max_new_tokens=max_new_tokens - i % 3)
        reqs.append(engine.submit(p, params))
        engine.step()
    engine.run()
    return generation_output(reqs)


def check_rollout_vs_training(path: str, prompt_count: int, max_new_tokens: int, tp: int = 1,
                              dtype: str = "float32") -> dict:
    import parallel_models as pm
    from parallel_models.llama.layers.exact import exact_mode
    from parallel_models.rl.roles.model_roles import PolicyRole, _response_log_probs, make_microbatches
    from parallel_models.utils.microbatch import restore_order

    pm.init_parallel(tensor_parallel_size=tp)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=getattr(torch, dtype))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 12, (prompt_count,), generator=g)]
    result = {}
    with exact_mode():
        out = _rollout(model, prompts, max_new_tokens)
        batch = {k: v.to(model.device) for k, v in dict(  # the trainer's batches live there
            sequences=out.sequences, attention_mask=out.attention_mask,
            prompt_lengths=out.prompt_mask.sum(-1), response_mask=out.response_mask).items()}
        mask = out.response_mask.bool().cpu()
        rollout = out.log_probs.cpu()[mask]
        result["tokens"] = int(mask.sum())
        result["exact_diff"] = {}
        for budget in (16, 10_000):  # one sequence per microbatch, all of them in one
            logp = PolicyRole(model, None, temperature=0.9, max_tokens=budget).log_probs(batch)
            logp = logp.cpu()
            result["exact_diff"][budget] = (None if torch.equal(logp[mask], rollout) else
                                            (logp[mask] - rollout).abs().max().item())
        # the update's forward, autograd on: the same bits, and gradients
        mbs, order = make_microbatches(batch, 10_000)
        assert len(mbs) == 1
        mb = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in mbs[0].items()}
        mask, rollout = mask.to(model.device), rollout.to(model.device)

        def update_forward():
            logits = model(mb["input_ids"], mb["cu_seqlens"], mb["position_ids"],
                           mb["max_seqlen"]).logits
            logp = restore_order([_response_log_probs(logits, mb, 0.9, True)[0]], order)
            logp[mask].sum().backward()
            return logp.detach()

        result["update_equal"] = torch.equal(update_forward()[mask], rollout)
        exact_grads = [p.grad.clone() if p.grad is not None else None
                       for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    logp = update_forward()
    result["grad_rel_err"] = max(((a - p.grad).norm() / (p.grad.norm() + 1e-12)).item()
                                 for a, p in zip(exact_grads, model.parameters())
                                 if a is not None)
    result["normal_diff"] = (logp[mask] - rollout).abs().max().item()
    return result
