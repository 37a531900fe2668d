"""A multi-turn arithmetic task where the ``calculator`` tool gives the exact answer (issue 34's
example; run it with ``parallel-models-ppo --config examples/agentic_arithmetic.yaml`` from the
repository root).

* :class:`Env` (``rollout.multi_turn.environment``): ``reset`` turns the dataset record into a
  system message describing the tool and the user's question; ``step`` lets the conversation go
  on while the model calls tools and ends it at the first turn without a tool call (its answer).
  The rollout appends the tool results itself (rendered with the chat template, masked 0).
* :func:`reward` (``reward.function``): 1 when the last number of the model's final turn equals
  the record's ``answer``, plus 0.1 when the model called the calculator without an error (a
  shaping bonus that the exact answer usually follows from). It reads the conversation and the
  tool trace the multi-turn rollout attaches to each record.

The model sees::

    system: you can call the calculator: <tool_call>{"name": "calculator", "arguments":
            {"expression": "..."}}</tool_call>. answer with the number.
    user: what is 37 * 48?
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 48"}}</tool_call>
    tool: 1776
    assistant: 1776
"""

from __future__ import annotations

import re

SYSTEM = ('you can call the calculator: <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "..."}}</tool_call>. answer with the number.')
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Env:
    """One conversation of the arithmetic task (see the module docstring)."""

    def reset(self, record):
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": str(record["prompt"])}]

    def step(self, turn_text, turn_ids):
        done = "<tool_call>" not in turn_text
        return [], None, done


def final_number(text: str):
    """The last number in ``text`` (None when there is none)."""
    numbers = _NUMBER.findall(text)
    return float(numbers[-1]) if numbers else None


def reward(prompts, responses, records=None, **extras):
    """Per sample: 1 for the exact answer in the final turn, + 0.1 for a calculator call that
    worked (see the module docstring)."""
    scores = []
    for i, _ in enumerate(responses):
        record = (records or [{}] * len(responses))[i] or {}
        turns = [m["content"] for m in record.get("conversation", []) if m["role"] == "assistant"]
        answer = final_number(turns[-1]) if turns else None
        score = float(answer is not None and record.get("answer") is not None
                      and abs(answer - float(record["answer"])) < 1e-9)
        if any(t["name"] == "calculator" and not t["error"] for t in record.get("tool_trace", [])):
            score += 0.1
        scores.append(score)
    return scores
