"""The continuous engine's pipelined decode (``ContinuousEngine(pipeline=True)``: each step queued
before the previous step's tokens are read) returns what the plain path returns: greedy with a
stop token, seeded sampling with top-p, n > 1, top log-probs, staggered arrivals under a tight KV
budget (rows finish while a step is queued ahead), fp32 on one gloo rank. And it does queue ahead
(a launch precedes the reading of the step before it)."""

from parallel_models.testing import run_distributed


def _run_both(path: str) -> dict:
    import torch

    import parallel_models as pm
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 12, (7,), generator=g)]
    probe = ContinuousEngine(model, 90, max_rows=4, pipeline=False)
    first = probe.submit(prompts[0], SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=4))
    probe.run()
    stop = first.samples[0].token_ids[2]  # greedy rows stop mid-way on it
    kinds = [SamplingParams(greedy=True, max_new_tokens=9, stop_token_ids=[stop]),
             SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=7, seed=5, n=3),
             SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=4)]
    out = {}
    for pipeline in (False, True):
        eng = ContinuousEngine(model, 90, max_rows=4, pipeline=pipeline)
        order = []
        for name in ("_launch", "_accept"):
            method = getattr(eng, name)
            setattr(eng, name, lambda *a, _m=method, _n=name, **k: (order.append(_n), _m(*a, **k))[1])
        reqs = []
        for i, p in enumerate(prompts):
            reqs.append(eng.submit(p, kinds[i % 3], stop_ids=kinds[i % 3].stop_ids(),
                                   top_logprobs=2 if i == 4 else 0))
            for _ in range(i % 2):
                eng.step()
        eng.run()
        out[pipeline] = {
            "samples": [[(s.token_ids, s.log_probs, s.top_logprobs, s.finish_reason)
                         for s in r.samples] for r in reqs],
            "queued_ahead": any(order[i:i + 3] == ["_launch", "_launch", "_accept"]
                                for i in range(len(order))),
            "pool_used_after": eng.scheduler.pool.used, "pending_after": eng._pending is not None}
    return out


def test_pipelined_decode_equals_plain(hf_models):
    out = run_distributed(_run_both, 1, hf_models[("llama", "causal_lm")], timeout=300)[0]
    plain, piped = out[False], out[True]
    assert piped["queued_ahead"] and not plain["queued_ahead"]
    assert piped["pool_used_after"] == 0 and not piped["pending_after"]
    for req_a, req_b in zip(plain["samples"], piped["samples"]):
        for (tok_a, lp_a, top_a, fin_a), (tok_b, lp_b, top_b, fin_b) in zip(req_a, req_b):
            assert tok_a == tok_b and fin_a == fin_b
            assert max(abs(a - b) for a, b in zip(lp_a, lp_b)) <= 1e-5
            if top_a is not None:
                assert [[t for t, _ in step] for step in top_a] == \
                    [[t for t, _ in step] for step in top_b]
    assert any(f == "stop" for req in piped["samples"] for *_, f in req), "no stop exercised"
