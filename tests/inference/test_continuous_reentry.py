"""Prefix-extending re-entry of the continuous engine (``submit(keep_kv=True)`` then
``submit(resume=request.kept)``), fp32 on gloo ranks at TP=1 and TP=2: a resumed request returns
the greedy tokens and log-probs of a fresh engine prefilling its whole prompt (the previous
behaviour), while running only its new tokens: fed through the next decode step when the bucket
has room (decode_layout.py; no prefill call), else prefilled (inference/kv_extend.py), the
resumes admitted together in one call, or some of each; a kept region that is large enough is taken over, a small one is copied
into a new region; a kept region is evicted when a request cannot fit (its resume then prefills
the whole prompt); released regions leave the pool empty. The scheduler alone: a moved
region is freed at the next admission, eviction takes the latest kept region first and the one
a request resumes from only when no row runs."""

import pytest
import torch

from parallel_models.testing import run_named_jobs
from tests.helpers.continuous_checks import _prompts


def _fresh(model, prompt, params):
    from parallel_models.inference.continuous import ContinuousEngine

    eng = ContinuousEngine(model, 400, max_rows=4)
    req = eng.submit(prompt, params)
    eng.run()
    return req.samples[0]


def _diff(a, b) -> tuple[bool, float]:
    same = a.token_ids == b.token_ids
    err = max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) if same else float("inf")
    return same, err


def check_reentry(path: str, tp: int) -> dict:
    import parallel_models as pm
    from parallel_models.inference.continuous import ContinuousEngine
    from parallel_models.inference.sampling import SamplingParams

    pm.init_parallel(tensor_parallel_size=tp)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    greedy = SamplingParams(greedy=True, max_new_tokens=6)
    res: dict = {}
    prompts = _prompts(3, seed=5)
    appended = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]

    # -- two re-entries of three conversations (4, 2 and 6 new tokens), each batch of resumes
    # admitted together: fed through decode steps, prefilled (feeding off), some of each (at
    # most 4 new tokens fed), fed with a step too small for all (4 rows + 5: the third waits
    # a step) --
    res["expected_new_tokens"] = [sum(len(a) + 1 for a in appended)] * 2
    for case, kwargs in (("fed", dict(max_rows=4)),
                         ("prefilled", dict(max_rows=4, decode_extension_tokens=0)),
                         ("mixed", dict(max_rows=4, decode_extension_tokens=4)),
                         ("fed_waiting", dict(max_rows=4, decode_extension_tokens=6))):
        eng = ContinuousEngine(model, 400, **kwargs)
        reqs = [eng.submit(p, greedy, keep_kv=True) for p in prompts]
        eng.run()
        contexts = [list(p) for p in prompts]
        out = res[case] = {"turns_equal": [], "logp_err": 0.0, "prefilled": [], "fed": [],
                           "calls": [], "moved": []}
        for turn in range(2):
            contexts = [c + r.samples[0].token_ids + a
                        for c, r, a in zip(contexts, reqs, appended)]
            tokens, fed, calls = eng.prefilled_tokens, eng.decode_fed_tokens, eng.prefill_calls
            reqs = [eng.submit(c, greedy, keep_kv=True, resume=r.kept)
                    for c, r in zip(contexts, reqs)]
            eng.run()
            out["prefilled"].append(eng.prefilled_tokens - tokens)
            out["fed"].append(eng.decode_fed_tokens - fed)
            out["calls"].append(eng.prefill_calls - calls)
            out["moved"].append([r.moved_from is not None for r in reqs])
            for c, r in zip(contexts, reqs):
                same, err = _diff(r.samples[0], _fresh(model, c, greedy))
                out["turns_equal"].append(same)
                out["logp_err"] = max(out["logp_err"], err)
        for r in reqs:
            eng.release_kept(r.kept)
            eng.release_kept(r.kept)  # twice: a no-op
        out["pool_used_after"] = eng.scheduler.pool.used
        out["waited"] = eng.fed_waiting_steps > 0

    # -- a kept region large enough is taken over (no copy) --
    long = SamplingParams(greedy=True, max_new_tokens=30)
    alone = _fresh(model, prompts[0], long).token_ids
    stop = alone[1]
    eng = ContinuousEngine(model, 400, max_rows=4)
    first = eng.submit(prompts[0], long, stop_ids=[stop], keep_kv=True)
    eng.run()
    context = prompts[0] + first.samples[0].token_ids + [4]
    short = SamplingParams(greedy=True, max_new_tokens=2)
    again = eng.submit(context, short, resume=first.kept)
    eng.run()
    res["taken_over"] = again.moved_from is None and again.extend_from == len(context) - 2
    res["taken_over_equal"] = _diff(again.samples[0], _fresh(model, context, short))[0]
    res["taken_over_pool_after"] = eng.scheduler.pool.used

    # -- eviction: a request that cannot fit evicts the kept region, while another row runs --
    eng = ContinuousEngine(model, 60, max_rows=3)
    running = eng.submit(prompts[0], SamplingParams(greedy=True, max_new_tokens=25 - len(
        prompts[0])))  # at [0, 25), at least 12 steps
    a = eng.submit(prompts[1], greedy, keep_kv=True)  # kept after 6 steps, after it
    eng.run(until=lambda: a.done)
    other = eng.submit(prompts[2], SamplingParams(greedy=True, max_new_tokens=35 - len(
        prompts[2])))
    eng.step()
    res["evicted"] = eng.scheduler.evicted
    res["evicted_while_running"] = bool(other.samples) and not running.done
    eng.run()
    context = prompts[1] + a.samples[0].token_ids + [3, 4]
    tokens = eng.prefilled_tokens
    back = eng.submit(context, greedy, resume=a.kept)
    eng.run()
    res["evicted_prefill"] = (eng.prefilled_tokens - tokens, len(context))
    res["evicted_equal"] = _diff(back.samples[0], _fresh(model, context, greedy))[0]

    # -- bad use --
    errors = []
    eng = ContinuousEngine(model, 400, max_rows=4)
    r = eng.submit(prompts[0], greedy, keep_kv=True)
    eng.run()
    for kwargs in ({"keep_kv": True, "params": SamplingParams(n=2, max_new_tokens=6)},
                   {"resume": r.kept, "prompt": [1] + prompts[0]}):
        try:
            eng.submit(kwargs.pop("prompt", prompts[0]), kwargs.pop("params", greedy), **kwargs)
        except ValueError as e:
            errors.append(str(e))
    res["errors"] = errors
    return res


@pytest.fixture(scope="module")
def results(hf_models):
    path = hf_models[("llama", "causal_lm")]
    return run_named_jobs([(tp, tp, (check_reentry, (path, tp))) for tp in (1, 2)], timeout=300)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", ["fed", "prefilled", "mixed", "fed_waiting"])
def test_resume_equals_a_fresh_prefill_and_runs_only_new_tokens(results, tp, case):
    for rank in results[tp]:
        r = rank[case]
        assert all(r["turns_equal"]), "a resumed request drew other tokens than a fresh one"
        assert r["logp_err"] <= 1e-5
        # the last drawn id of each turn (never fed) + the appended ids, nothing else
        new = [p + f for p, f in zip(r["prefilled"], r["fed"])]
        assert new == rank["expected_new_tokens"]
        if case.startswith("fed"):  # no prefill call: decode steps ran them
            assert r["calls"] == [0, 0] and r["prefilled"] == [0, 0]
        elif case == "prefilled":  # resumes admitted together share one prefill call
            assert r["calls"] == [1, 1] and r["fed"] == [0, 0]
        else:  # the third's 6 new tokens are over the 4 fed: prefilled
            assert r["calls"] == [1, 1] and r["fed"] == [6, 6]
        if case == "fed_waiting":  # 12 entries, 9 a step: the third joined a step later
            assert r["waited"]
        assert all(all(m) for m in r["moved"]), "longer rows were meant to move region"
        assert r["pool_used_after"] == 0
    assert results[tp][0][case]["turns_equal"] == results[tp][-1][case]["turns_equal"]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_large_enough_kept_region_is_taken_over(results, tp):
    r = results[tp][0]
    assert r["taken_over"] and r["taken_over_equal"] and r["taken_over_pool_after"] == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_eviction_makes_room_and_the_evicted_resume_prefills_all(results, tp):
    r = results[tp][0]
    assert r["evicted"] == 1 and r["evicted_while_running"]
    assert r["evicted_prefill"][0] == r["evicted_prefill"][1]
    assert r["evicted_equal"]


def test_bad_use_is_refused(results):
    keep_n2, not_extending = results[1][0]["errors"]
    assert "keep_kv needs n=1" in keep_n2
    assert "does not extend" in not_extending


class _Req:
    def __init__(self, row_tokens, resume=None):
        self.n, self.row_tokens, self.resume = 1, row_tokens, resume
        self.extend_from, self.moved_from = 0, None


def test_scheduler_kept_regions_move_and_eviction_order():
    from parallel_models.inference.scheduler import Scheduler

    s = Scheduler(100, max_rows=4, max_row_tokens=100)
    first, second, third = _Req(20), _Req(20), _Req(20)
    for r in (first, second, third):
        s.add(r)
    assert [st for _, (st,) in s.admit()] == [0, 20, 40]
    kept = [s.keep(0, 20, range(15)), s.keep(20, 20, range(10)), s.keep(40, 20, range(12))]
    assert s.rows_used == 0 and s.pool.used == 60
    # a larger resume moves: a new region, the old one freed only at the next admission
    grown = _Req(30, resume=kept[0])
    s.add(grown)
    assert s.admit() == [(grown, [60])]
    assert (grown.extend_from, grown.moved_from) == (15, 0) and not kept[0].live
    assert s.pool.used == 90
    s.admit()
    assert s.pool.used == 70
    # a request that cannot fit evicts the latest kept first, never a kept region it resumes
    # from while rows run
    big = _Req(85, resume=kept[1])
    s.add(big)
    assert s.admit() == [] and s.evicted == 1 and not kept[2].live and kept[1].live
    s.release(60, 30)  # the grown row finishes: nothing runs
    started = s.admit()  # its own kept region goes too, then it fits
    assert started == [(big, [0])] and s.evicted == 2 and not kept[1].live
    assert big.extend_from == 0 and big.moved_from is None  # evicted: a whole prefill
