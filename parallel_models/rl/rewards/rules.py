"""Rule-based rewards: ``fn(prompts: list[str], responses: list[str], **extras) -> list[float]``.

A reward function gets the decoded prompts and responses of a batch (one entry per sampled
sequence, special tokens removed) and returns one float per response. ``extras`` are keyword
arguments the trainer may pass along (e.g. ``records=``, the data records the prompts came from,
one per response); a function should accept ``**extras`` and ignore what it does not use.

Select one with ``reward.function``: a built-in's name (``vowel_reward``, the names registered in
:data:`REWARD_FUNCTIONS`), ``package.module.function`` (or ``package.module:function``), or
``path/to/file.py:function``; :func:`load_reward_function` resolves it with clear errors.

Built-in examples:

* :func:`vowel_reward` (the default run's reward): the share of response characters that are
  vowels, minus a penalty for responses shorter than ``min_length``.
* :func:`length_reward`: closeness of the response length to a target length.
* :func:`exact_match`: 1 if the response equals the record's reference answer.
* :func:`math_reward`: 1 if the response's final answer (``\\boxed{}``, ``#### x``, last number)
  equals the reference as a number or expression (GSM8K / MATH style).

How the trainer calls a reward function (dataset fields, verl's ``compute_score`` convention) is
in ``parallel_models.rl.rewards.calls``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from parallel_models.config import ConfigError
from parallel_models.rl.registry import Registry, load_function

RewardFn = Callable[..., Sequence[float]]

# the built-in rules by name (reward.function=vowel_reward); no call-signature check here: how a
# rule is called depends on the convention it declares (parallel_models.rl.rewards.calls)
REWARD_FUNCTIONS = Registry("reward function")

VOWELS = "aeiou"


@REWARD_FUNCTIONS.register("vowel_reward")
def vowel_reward(prompts: Sequence[str], responses: Sequence[str], target: str = VOWELS,
                 min_length: int = 4, short_penalty: float = 0.5, **extras: Any) -> list[float]:
    """Share of the response's characters that are in ``target`` (vowels), in [0, 1], minus
    ``short_penalty * (min_length - len) / min_length`` for responses shorter than ``min_length``
    (an empty response scores ``-short_penalty``).

    Why PPO on a random tiny character-level model improves it quickly: every response token is
    one character, and every character choice moves the score directly (by about 1/length), so
    the credit of each token is immediate and dense, nothing has to be planned. A random policy
    over the ~74-token built-in vocabulary scores about 5/74 ~ 0.07; raising the probability of
    five output tokens is enough to climb towards 1. The length penalty keeps the easy way out,
    an immediate EOS (score 0 otherwise), from being a local optimum.
    """
    target_set = set(target.lower())
    scores = []
    for response in responses:
        text = response.lower()
        share = sum(ch in target_set for ch in text) / len(text) if text else 0.0
        shortfall = max(0, min_length - len(text))
        scores.append(share - short_penalty * shortfall / max(min_length, 1))
    return scores


@REWARD_FUNCTIONS.register("length_reward")
def length_reward(prompts: Sequence[str], responses: Sequence[str], target_length: int = 8,
                  **extras: Any) -> list[float]:
    """``1 - |len(response) - target_length| / target_length``, floored at -1 (characters)."""
    return [max(-1.0, 1.0 - abs(len(r) - target_length) / max(target_length, 1))
            for r in responses]


REFERENCE_KEYS = ("ground_truth", "answer", "solution")


def reference_of(record: dict, keys: Sequence[str] = REFERENCE_KEYS):
    """A record's reference answer: the first of ``keys`` present, also inside verl's nested
    ``reward_model: {ground_truth: ...}``; None when there is none."""
    for key in keys:
        if record.get(key) is not None:
            return record[key]
    nested = record.get("reward_model")
    if isinstance(nested, dict) and nested.get("ground_truth") is not None:
        return nested["ground_truth"]
    return None


def _references(name: str, responses: Sequence[str], answers, records, answer_key: str | None):
    if answers is None:
        if records is None:
            raise ValueError(f"{name} needs the reference answers: pass answers=[...] or "
                             f"records=[...] with a {answer_key or REFERENCE_KEYS[0]!r} field")
        keys = (answer_key,) if answer_key else REFERENCE_KEYS
        answers = [reference_of(rec, keys) for rec in records]
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:
            fields = ", ".join(repr(k) for k in keys)
            raise ValueError(f"{name}: records {missing[:5]} have none of the fields {fields} "
                             f"(keys: {sorted(records[missing[0]])})")
    if len(answers) != len(responses):
        raise ValueError(f"{name}: {len(answers)} answers for {len(responses)} responses")
    return answers


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(prompts: Sequence[str], responses: Sequence[str],
                answers: Sequence[str] | None = None, records: Sequence[dict] | None = None,
                answer_key: str | None = None, **extras: Any) -> list[float]:
    """1.0 where the stripped response equals the reference answer (case-insensitive), else 0.

    The references come from ``answers`` (one per response) or from the records: ``answer_key``
    if given, else the first of ``ground_truth``, ``answer``, ``solution`` (or verl's
    ``reward_model.ground_truth``).
    """
    answers = _references("exact_match", responses, answers, records, answer_key)
    return [float(r.strip().lower() == str(a).strip().lower()) for r, a in zip(responses, answers)]


@REWARD_FUNCTIONS.register("math_reward")
def math_reward(prompts: Sequence[str], responses: Sequence[str],
                answers: Sequence[str] | None = None, records: Sequence[dict] | None = None,
                answer_key: str | None = None, format_score: float = 0.0,
                **extras: Any) -> list[float]:
    """1.0 where the response's final answer (``\\boxed{}``, ``#### x``, "the answer is x", else
    its last number) equals the reference as a number or normalized expression; ``format_score``
    where it gives an answer that is wrong; 0 where it gives none. References as in
    :func:`exact_match` (a GSM8K-style reference ``"... #### 42"`` counts as ``42``).
    """
    from parallel_models.rl.rewards.math_answers import answers_equal, extract_answer

    answers = _references("math_reward", responses, answers, records, answer_key)
    scores = []
    for response, reference in zip(responses, answers):
        reference = str(reference)
        if "####" in reference or "\\boxed" in reference:
            reference = extract_answer(reference) or reference
        predicted = extract_answer(response)
        if predicted is None:
            scores.append(0.0)
        else:
            scores.append(1.0 if answers_equal(predicted, reference) else float(format_score))
    return scores


def load_reward_function(path: str) -> RewardFn:
    """Resolve a registered name (``"vowel_reward"``), ``"package.module.function"``,
    ``"package.module:function"`` or ``"file.py:function"`` to a callable; raise
    :class:`ConfigError` saying what is wrong."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"reward function {path!r}: expected a dotted path like "
                          "'package.module.function'")
    path = path.strip()
    if path in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS.get(path)
    if ":" not in path and "." not in path:
        raise ConfigError(f"reward function {path!r}: expected a dotted path like "
                          "'package.module.function' (module and function name) or "
                          f"{REWARD_FUNCTIONS.unknown_message(path)}")
    return load_function(path, REWARD_FUNCTIONS.kind)


__all__ = ["vowel_reward", "length_reward", "exact_match", "math_reward", "reference_of",
           "load_reward_function", "RewardFn", "VOWELS", "REWARD_FUNCTIONS"]
