"""The environment interface of a multi-turn rollout (``rollout.multi_turn.environment``).

An environment is a class, named as ``path/to/file.py:Env`` (or ``package.module:Env``); the
rollout makes one instance per conversation (``Env()``, no arguments) and calls

* ``reset(record) -> list of messages``: the conversation's first messages (chat dicts:
  ``{"role": "system" | "user" | ..., "content": str}``) for the data ``record`` (the dataset
  row of the prompt; it holds the prompt text under ``prompt``). An empty list keeps the
  dataset's prompt as it is.
* ``step(turn_text, turn_ids) -> (messages, reward, done)`` after every model turn (and after the
  turn's tool calls ran): ``turn_text`` is the decoded turn, ``turn_ids`` its generated token
  ids; ``messages`` are appended to the conversation as the observation (usually ``role:
  user``), ``reward`` (a float or None) is added to the sample's reward, and ``done`` ends the
  conversation. A :class:`StepResult` works too.

Without an environment a conversation ends with the first turn that calls no tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from parallel_models.errors import ConfigError
from parallel_models.rl.registry import Registry


@dataclass
class StepResult:
    """What ``step`` returns: observation messages, a reward (None: none) and done."""

    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """See the module docstring."""

    def reset(self, record: dict) -> Sequence[dict]:
        ...

    def step(self, turn_text: str, turn_ids: Sequence[int]) -> Any:
        ...


ENVIRONMENTS = Registry("environment", key="rollout.multi_turn.environment",
                        home="parallel_models.rl.agents.environment.ENVIRONMENTS")


def load_environment(spec: str) -> type:
    """The environment class ``spec`` names (registered, or ``file.py:Env``)."""
    cls = ENVIRONMENTS.get(spec)
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ConfigError(f"rollout.multi_turn.environment={spec!r}: {cls!r} has no "
                              f"{method}() method; an environment defines reset(record) and "
                              "step(turn_text, turn_ids)")
    return cls


def step_result(value: Any, spec: str = "environment") -> StepResult:
    """``step``'s return value as a :class:`StepResult`; ValueError naming ``spec`` when it is
    neither one nor a ``(messages, reward, done)`` tuple of the right kinds."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 3:
        result = StepResult(list(value[0] or []), value[1], bool(value[2]))
    else:
        raise ValueError(f"{spec}: step() must return (messages, reward, done) or a "
                         f"StepResult, got {value!r}"[:300])
    check_messages(result.messages, f"{spec}: step()")
    if result.reward is not None:
        result.reward = float(result.reward)
    return result


def check_messages(messages: Any, where: str) -> list[dict]:
    """``messages`` if it is a list of chat messages (dicts with a string role and content)."""
    if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"{where} must give a list of chat messages ({{'role': str, "
                         f"'content': str}}), got {messages!r}"[:300])
    return list(messages)


__all__ = ["ENVIRONMENTS", "Environment", "StepResult", "check_messages", "load_environment",
           "step_result"]
