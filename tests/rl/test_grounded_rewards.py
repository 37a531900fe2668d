"""Rewards grounded in the dataset: answer extraction, math/exact-match scorers, the calling
conventions (record columns as keywords, verl's compute_score), per-source metrics, built-in tasks."""

from __future__ import annotations

import pytest

from parallel_models.rl.rewards.math_answers import answers_equal, extract_answer
from parallel_models.rl.rewards.calls import call_reward_function
from parallel_models.rl.rewards.rules import exact_match, math_reward
from parallel_models.rl.data.tasks import first_number_match, task_records


@pytest.mark.parametrize("text,reference,equal", [
    ("so \\boxed{\\frac{1}{2}} done", "0.5", True),
    ("first \\boxed{3}, then \\boxed{\\frac{3}{4}}", "3/4", True),     # the last box counts
    ("\\boxed{{a}{b}}", "{a}{b}", True),                               # nested braces
    ("#### 1,234", "1234", True),                                       # GSM8K line
    ("The answer is 42.", "42", True),
    ("we get 3 apples then 7", "7", True),                              # last number
    ("$\\boxed{12\\%}$", "0.12", True),
    ("\\boxed{x^2 + 1}", "x^2+1", True),                                # expression, spacing
    ("\\boxed{\\text{Paris}}", "paris", True),
    ("answer: $5", "5", True),
    ("-3.50", "-3.5", True),
    ("\\boxed{1/3}", "0.333333", False),                               # exact rationals
    ("2", "3", False),
    ("nothing here", "5", False),
])
def test_answer_extraction_and_equivalence(text, reference, equal):
    assert answers_equal(extract_answer(text), reference) is equal


def test_math_and_exact_match_read_references_from_records():
    records = [{"ground_truth": "4"}, {"answer": "#### 4"}, {"reward_model": {"ground_truth": "4"}},
               {"solution": "1000"}]
    responses = ["so \\boxed{4}", "I think 5", "no idea", "#### 1,000"]
    assert math_reward([""] * 4, responses, records=records, format_score=0.1) == [1.0, 0.1, 0.0, 1.0]
    assert exact_match([""] * 2, [" Paris", "rome"], records=[{"ground_truth": "paris"}] * 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="'ground_truth', 'answer', 'solution'"):
        math_reward([""], ["1"], records=[{"label": 1}])


def test_record_fields_reach_a_custom_reward_function():
    seen = {}

    def custom(prompts, responses, ground_truth, difficulty, records):
        seen.update(ground_truth=ground_truth, difficulty=difficulty, records=records)
        return [float(r == g) for r, g in zip(responses, ground_truth)]

    records = [{"prompt": "p", "ground_truth": "a", "difficulty": 1, "data_source": "s1"},
               {"prompt": "q", "ground_truth": "b", "difficulty": 2, "data_source": "s2"}]
    scores, metrics = call_reward_function(custom, ["p", "q"], ["a", "x"], records)
    assert scores == [1.0, 0.0]
    assert seen["ground_truth"] == ["a", "b"] and seen["difficulty"] == [1, 2]
    assert seen["records"] == records
    assert metrics == {"reward/s1/mean": 1.0, "reward/s2/mean": 0.0}


def test_verl_compute_score_convention():
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": float(solution_str == ground_truth), "acc": 1.0}

    records = [{"data_source": "gsm8k", "reward_model": {"ground_truth": "7"},
                "extra_info": {"index": 3}}]
    scores, metrics = call_reward_function(compute_score, ["p"], ["7"], records)
    assert scores == [1.0]
    assert calls == [("gsm8k", "7", "7", {"index": 3})]
    assert metrics["reward/acc"] == 1.0 and metrics["reward/gsm8k/mean"] == 1.0


def test_reward_function_must_return_one_score_per_response():
    with pytest.raises(ValueError, match="1 scores for 2 responses"):
        call_reward_function(lambda p, r, **kw: [1.0], ["a", "b"], ["a", "b"])


def test_builtin_tasks_hold_out_prompts_and_score_exactly():
    for task, total in (("find_digit", 500), ("max_digit", 100), ("last_digit", 100),
                        ("add_mod10", 100)):
        train, val = task_records(task, "train"), task_records(task, "val")
        assert (len(train), len(val)) == (total * 4 // 5, total // 5)
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
        assert task_records(task, "val") == val  # deterministic
    rec = task_records("max_digit", "val")[0]
    a, b = (int(x) for x in rec["prompt"].removeprefix("max ").rstrip("=").split())
    assert rec["ground_truth"] == str(max(a, b)) and rec["data_source"] == "max_digit"
    assert first_number_match(["", "", ""], ["7abc", "x07", "no"], ground_truth=["7", "7", "7"]) == \
        [1.0, 1.0, 0.0]
    assert first_number_match([""] * 2, ["3", "x"], ground_truth=["7", "7"], format_score=0.1) == \
        [0.1, 0.0]
    for rec in task_records("find_digit", "val"):
        digits = [ch for ch in rec["prompt"] if ch.isdigit()]
        assert digits == [rec["ground_truth"]]
    with pytest.raises(ValueError, match="not a built-in task"):
        task_records("sorting")
