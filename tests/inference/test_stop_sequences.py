"""Stop token sequences (parallel_models/inference/stop_sequences.py) in both batchers of the
rollout engine, fp32 on one gloo rank: with ``stop_sequences`` each greedy row is the row the
engine returns without them (the previous behaviour, the oracle) cut right after the first
sequence it generates, with the same log-probs and ``finish_reason: "stop"``; a sequence that
would only match across the prompt's end does not stop; rows that never meet one are unchanged."""

import pytest

from parallel_models.testing import run_distributed

MAX_NEW = 12


def _first_end(ids, sequences):
    """Index after the first generated sequence in ``ids`` (None: none)."""
    for end in range(1, len(ids) + 1):
        if any(end >= len(s) and ids[end - len(s):end] == s for s in sequences):
            return end
    return None


def _run(path: str) -> dict:
    import torch

    import parallel_models as pm
    from parallel_models.inference import RolloutEngine, SamplingParams

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in (5, 9, 3, 7)]
    params = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)
    out = {}
    for name, engine in (("static", RolloutEngine(model)),
                         ("continuous", RolloutEngine(model, kv_budget_tokens=200, max_rows=3))):
        base = engine.generate_samples(prompts, params)
        ids0 = base[0]["token_ids"]
        # a 2-token sequence row 0 first generates at positions 3..4 (or later, if it repeats)
        k = next(k for k in range(3, MAX_NEW - 1)
                 if _first_end(ids0, [ids0[k:k + 2]]) == k + 2)
        across = [prompts[1][-1], base[1]["token_ids"][0]]  # would match across the prompt end
        sequences = [ids0[k:k + 2], across, [base[2]["token_ids"][5]]]
        got = engine.generate_samples(prompts, params, stop_sequences=sequences)
        out[name] = {"base": base, "got": got, "sequences": sequences}
    return out


@pytest.fixture(scope="module")
def results(hf_models):
    return run_distributed(_run, 1, hf_models[("llama", "causal_lm")], timeout=300)[0]


@pytest.mark.parametrize("batcher", ["static", "continuous"])
def test_rows_stop_after_a_stop_sequence(results, batcher):
    r = results[batcher]
    cut = 0
    for base, got in zip(r["base"], r["got"]):
        ids = base["token_ids"]
        end = _first_end(ids, r["sequences"])
        if end is None or end == len(ids) and base["finish_reason"] == "length":
            assert got["token_ids"] == ids[:end or len(ids)]
            continue
        cut += 1
        assert got["token_ids"] == ids[:end]
        assert got["finish_reason"] == "stop"
        assert got["log_probs"] == pytest.approx(base["log_probs"][:end], abs=1e-6)
    assert cut >= 2  # rows 0 and 2 at least
    assert len(r["got"][0]["token_ids"]) < MAX_NEW


def test_both_batchers_agree(results):
    assert [s["token_ids"] for s in results["static"]["got"]] == \
        [s["token_ids"] for s in results["continuous"]["got"]]


def test_bad_stop_sequences():
    from parallel_models.inference.stop_sequences import check_stop_sequences

    assert check_stop_sequences([[1, 2], (3,)]) == ((1, 2), (3,))
    with pytest.raises(ValueError, match=r"stop_sequences\[1\] is empty"):
        check_stop_sequences([[1], []])
    with pytest.raises(ValueError, match="negative"):
        check_stop_sequences([[-1]])
