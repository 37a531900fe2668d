"""Worker for the continuous-batching tests (run on gloo ranks): staggered arrivals vs each
request alone vs transformers.generate, the KV budget, prefix sharing, seeded sampling amid other
traffic, the prompt LRU."""

from __future__ import annotations

import torch

MAX_NEW = 10


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (int(n),), generator=g).tolist()
            for n in torch.randint(2, 14, (count,), generator=g)]


def _fresh_log_probs(model, prompt, tokens, temperature):
    ids = torch.tensor(prompt + tokens)
    cu = torch.tensor([0, len(ids)], dtype=torch.int32)
    with torch.no_grad():
        logits = model(ids, cu, full_vocab=True).logits.float() / temperature
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def check_continuous(path: str, tp: int) -> dict:
    import parallel_models as pm
    from transformers import AutoModelForCausalLM

    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.inference.scheduler import KVBudgetError

    pm.init_parallel(tensor_parallel_size=tp)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    res: dict = {}
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW, stop_token_ids=[7])
    prompts = _prompts(10)

    # -- staggered arrivals under a tight budget: rows join and leave, requests wait --
    eng = ContinuousEngine(model, 80, max_rows=4)
    reqs, waited, over_budget = [], False, False
    for i, p in enumerate(prompts):
        reqs.append(eng.submit(p, greedy.model_copy(update={"max_new_tokens": MAX_NEW - i % 4})))
        for _ in range(i % 3):  # 0-2 steps between arrivals
            eng.step()
            waited |= bool(eng.scheduler.waiting)
            over_budget |= eng.scheduler.pool.used > 80
    eng.run()
    staggered = [r.samples[0] for r in reqs]
    alone = []
    for i, p in enumerate(prompts):
        one = ContinuousEngine(model, 80, max_rows=4)
        r = one.submit(p, greedy.model_copy(update={"max_new_tokens": MAX_NEW - i % 4}))
        one.run()
        alone.append(r.samples[0])
    res["waited"], res["over_budget"] = waited, over_budget
    res["pool_used_after"] = eng.scheduler.pool.used
    res["staggered_vs_alone"] = [i for i, (a, b) in enumerate(zip(staggered, alone))
                                 if a.token_ids != b.token_ids
                                 or max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) > 1e-5]
    mismatch = []
    for i, (p, s) in enumerate(zip(prompts, staggered)):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=MAX_NEW - i % 4, do_sample=False, pad_token_id=0,
                          eos_token_id=7)[0, len(p):].tolist()
        if ref != s.token_ids or s.finish_reason != ("stop" if ref[-1] == 7 else "length"):
            mismatch.append(i)
    res["staggered_vs_hf"] = mismatch
    res["tokens"] = [s.token_ids for s in staggered]

    # -- prompts starting together prefilled in small packs: the same tokens --
    packs = ContinuousEngine(model, 400, max_rows=16, max_prefill_tokens=20)
    chunked = [packs.submit(p, greedy.model_copy(update={"max_new_tokens": MAX_NEW - i % 4}))
               for i, p in enumerate(prompts)]
    packs.run()
    res["chunked_prefill_equal"] = [r.samples[0].token_ids for r in chunked] == res["tokens"]

    # -- a request that can never fit: an error at once, nothing queued --
    errors = []
    for n, new in ((1, 200), (3, 30), (5, 1)):
        try:
            eng.submit(prompts[0], SamplingParams(greedy=True, n=n, max_new_tokens=new))
            errors.append(None)
        except KVBudgetError as exc:
            errors.append(str(exc))
    res["budget_errors"] = errors
    res["queued_after_errors"] = len(eng.scheduler.waiting)

    # -- n samples share one prefill; equal to separately prefilled requests --
    shared = ContinuousEngine(model, 200, max_rows=8)
    r = shared.submit(prompts[1], greedy.model_copy(update={"n": 3}))
    shared.run()
    res["shared_prefills"] = shared.prefilled_prompts
    separate = []
    for _ in range(3):  # one at a time: each prefilled on its own
        one = shared.submit(prompts[1], greedy)
        shared.run()
        separate.append(one.samples[0])
    res["shared_prefills_total"] = shared.prefilled_prompts
    res["shared_equal"] = all(s.token_ids == t.token_ids for s, t in zip(r.samples, separate))
    res["shared_logp_err"] = max(abs(x - y) for s, t in zip(r.samples, separate)
                                 for x, y in zip(s.log_probs, t.log_probs))

    # -- a seeded request draws the same alone and amid other traffic --
    seeded = SamplingParams(n=2, temperature=0.8, top_k=20, max_new_tokens=MAX_NEW, seed=7)
    alone_eng = ContinuousEngine(model, 300, max_rows=8)
    a = alone_eng.submit(prompts[2], seeded)
    alone_eng.run()
    busy = ContinuousEngine(model, 300, max_rows=8)
    torch.manual_seed(123)
    for p in prompts[3:6]:
        busy.submit(p, SamplingParams(temperature=1.3, top_p=0.9, max_new_tokens=MAX_NEW))
        busy.step()
    b = busy.submit(prompts[2], seeded)
    busy.submit(prompts[6], greedy)
    busy.run()
    res["seeded_same"] = [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    res["seeded_samples_differ"] = a.samples[0].token_ids != a.samples[1].token_ids
    res["seeded_logp_vs_fresh"] = max(
        (_fresh_log_probs(model, prompts[2], s.token_ids, 0.8)
         - torch.tensor(s.log_probs)).abs().max().item() for s in b.samples)

    # -- the prompt LRU: an identical prompt skips its prefill; bounded; cleared --
    lru = ContinuousEngine(model, 200, max_rows=4, prefix_cache_tokens=24)
    first = lru.submit(prompts[3], greedy)
    lru.run()
    again = lru.submit(prompts[3], greedy)
    lru.run()
    res["lru_prefills"] = lru.prefilled_prompts
    res["lru_hits"] = lru.prefixes.hits
    res["lru_equal"] = first.samples[0].token_ids == again.samples[0].token_ids
    for p in prompts[4:9]:
        lru.submit(p, greedy)
    lru.run()
    res["lru_tokens"] = lru.prefixes.tokens
    lru.clear_prefixes()
    lru.submit(prompts[3], greedy)
    before = lru.prefilled_prompts
    lru.run()
    res["lru_prefilled_after_clear"] = lru.prefilled_prompts - before

    # -- RolloutEngine (the trainer's entry point) in continuous mode == static, greedy --
    from parallel_models.inference.engine import RolloutEngine

    params = SamplingParams(greedy=True, n=2, max_new_tokens=MAX_NEW)
    static = RolloutEngine(model, eos_token_id=7).generate(prompts[:5], params)
    cont = RolloutEngine(model, eos_token_id=7, kv_budget_tokens=100, max_rows=4)
    got = cont.generate(prompts[:5], params)
    res["engine_equal"] = all(torch.equal(getattr(static, f), getattr(got, f)) for f in
                              ("prompts", "prompt_mask", "responses", "response_mask"))
    res["engine_logp_err"] = (static.log_probs - got.log_probs).abs().max().item()
    res["engine_tokens_counted"] = cont.generated_tokens == int(got.response_mask.sum())
    sampled = SamplingParams(n=2, max_new_tokens=MAX_NEW, temperature=0.9, seed=11)
    one, two = cont.generate(prompts[:5], sampled), cont.generate(prompts[:5], sampled)
    res["engine_seeded_same"] = torch.equal(one.responses, two.responses)
    pm.destroy_parallel()
    return res
