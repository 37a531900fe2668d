"""The token ids a multi-turn rollout appends after a model turn: the next messages (tool
results, environment observations) rendered with the model's chat template.

Token in, token out: the model's turn is never re-tokenized. What is appended is the *text
suffix* the chat template puts after the model's turn: the template renders
``[user, assistant(SENTINEL), *new_messages]`` with the generation prompt, and everything after
``SENTINEL`` -- the end of the assistant message, the new messages, the opening of the next
assistant turn -- is tokenized on its own (no special tokens added). When the turn ended with a
stop token whose text starts that suffix (``<|im_end|>``, the built-in ``</s>``), that text is
the model's own token and is dropped from the suffix. A template that renders the assistant's
content other than verbatim (so the sentinel is not found) is a ``ConfigError``.
"""

from __future__ import annotations

from typing import Sequence

from parallel_models.errors import ConfigError

SENTINEL = "\u2063AGENT_TURN_SENTINEL\u2063"  # never produced by a model turn


def appended_text(tokenizer, messages: Sequence[dict], stop_text: str | None) -> str:
    """The text the chat template puts after a model turn and before the next one, for the new
    ``messages``; ``stop_text``: the decoded stop token the turn ended with (None: none)."""
    conversation = [{"role": "user", "content": "x"},
                    {"role": "assistant", "content": SENTINEL}, *messages]
    try:
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template error names the template's problem
        raise ConfigError(f"rollout.multi_turn: the chat template cannot render the tool / "
                          f"environment messages {list(messages)!r}: {err}") from err
    at = rendered.rfind(SENTINEL)
    if at < 0:
        raise ConfigError("rollout.multi_turn: the chat template does not render an assistant "
                          "message's content verbatim, so the tokens after a model turn cannot "
                          "be told from it")
    suffix = rendered[at + len(SENTINEL):]
    if stop_text and suffix.startswith(stop_text):
        suffix = suffix[len(stop_text):]
    return suffix


def appended_ids(tokenizer, messages: Sequence[dict], stop_text: str | None) -> list[int]:
    """:func:`appended_text`'s token ids (tokenized alone, no special tokens added)."""
    return list(tokenizer(appended_text(tokenizer, messages, stop_text),
                          add_special_tokens=False)["input_ids"])


def cap_content(tokenizer, text: str, max_tokens: int | None) -> tuple[str, bool]:
    """``text`` cut to its first ``max_tokens`` tokens (None: no cap) and whether it was cut."""
    if max_tokens is None:
        return text, False
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens]) + " [truncated]", True


__all__ = ["SENTINEL", "appended_ids", "appended_text", "cap_content"]
