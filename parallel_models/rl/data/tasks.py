"""Built-in verifiable tasks, generated on the spot: prompts with exact answers and a held-out split.

``data.task: find_digit`` (or ``last_digit``, ``max_digit``, ``add_mod10``) replaces the prompt
file: every record is ``{"prompt", "ground_truth", "data_source"}``, and the validation set holds
prompts that never appear in training (other strings / operand pairs), so the held-out accuracy
measures what the policy learned rather than what it memorized. Every answer is a digit spread
evenly over 0-9 except ``max_digit``'s (9 is the answer 19% of the time: a policy can reach that
by always answering 9). The matching reward is :func:`first_number_match` (the
first integer of the response against the answer), which a character-level policy can satisfy
without learning to stop. (A ``format_score`` for wrong numbers was tried on the built-in tiny
model: it collapses the policy onto one constant digit within ~30 steps.)

=============  =====================  ===========================================
task           prompt                 answer
=============  =====================  ===========================================
find_digit     ``digit in kq3wz=``    the one digit among the letters (500 prompts)
last_digit     ``last of 37=``        the second digit
max_digit      ``max 3 8=``           the larger digit
add_mod10      ``3+8 mod 10=``        the last digit of the sum
=============  =====================  ===========================================
"""

from __future__ import annotations

import random
import re
import string
from typing import Callable, Sequence

_FIRST_INT = re.compile(r"-?\d+")


def _last_digit(a: int, b: int) -> tuple[str, str]:
    return f"last of {a}{b}=", str(b)


def _max_digit(a: int, b: int) -> tuple[str, str]:
    return f"max {a} {b}=", str(max(a, b))


def _add_mod10(a: int, b: int) -> tuple[str, str]:
    return f"{a}+{b} mod 10=", str((a + b) % 10)


TASKS: dict[str, Callable[[int, int], tuple[str, str]]] = {
    "last_digit": _last_digit,
    "max_digit": _max_digit,
    "add_mod10": _add_mod10,
}
FIND_DIGIT_PROMPTS = 500


def _find_digit_pairs(seed: int) -> list[tuple[str, str]]:
    """``digit in kq3wz=`` -> ``3``: five letters with one digit among them (distinct strings)."""
    rng = random.Random(10_007 + seed)
    seen, out = set(), []
    while len(out) < FIND_DIGIT_PROMPTS:
        letters = [rng.choice(string.ascii_lowercase) for _ in range(5)]
        digit = str(rng.randrange(10))
        letters.insert(rng.randrange(6), digit)
        text = "".join(letters)
        if text not in seen:
            seen.add(text)
            out.append((f"digit in {text}=", digit))
    return out


def task_records(task: str, split: str = "train", seed: int = 0,
                 val_fraction: float = 0.2) -> list[dict]:
    """All records of ``task``'s ``split`` ("train" or "val"): the 100 operand pairs (a, b) of
    digits, shuffled with ``seed`` and split so no validation prompt is a training prompt."""
    if task not in TASKS and task != "find_digit":
        raise ValueError(f"data.task {task!r} is not a built-in task; choose one of "
                         f"{', '.join(sorted([*TASKS, 'find_digit']))}")
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if task == "find_digit":
        items = _find_digit_pairs(seed)
    else:
        items = [TASKS[task](a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(items)
    n_val = max(1, round(len(items) * val_fraction))
    chosen = items[:n_val] if split == "val" else items[n_val:]
    return [{"prompt": prompt, "ground_truth": answer, "data_source": task}
            for prompt, answer in chosen]


def first_number_match(prompts: Sequence[str], responses: Sequence[str],
                       ground_truth: Sequence[str] | None = None, format_score: float = 0.0,
                       **extras) -> list[float]:
    """1.0 where the first integer in the response equals ``ground_truth`` (as integers),
    ``format_score`` where the response starts its answer with another number, 0 where it has
    no number."""
    if ground_truth is None:
        raise ValueError("first_number_match needs ground_truth=[...] (records with a "
                         "'ground_truth' field, e.g. a built-in data.task)")
    if len(ground_truth) != len(responses):
        raise ValueError(f"first_number_match: {len(ground_truth)} answers for "
                         f"{len(responses)} responses")
    scores = []
    for response, answer in zip(responses, ground_truth):
        m = _FIRST_INT.search(response)
        if m is None or answer is None:
            scores.append(0.0)
        else:
            scores.append(1.0 if int(m.group()) == int(answer) else float(format_score))
    return scores


__all__ = ["TASKS", "task_records", "first_number_match"]
