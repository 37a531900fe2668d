"""One multi-turn conversation's bookkeeping, shared by the turn-synchronous and the
asynchronous drivers of ``multi_turn.py`` / ``async_turns.py``.

:class:`ConversationTurns` holds what does not change during a rollout (tokenizer, budgets,
executor, environment class, the stop ids / sequences of a turn) and does each step of a
conversation (:class:`Conversation`):

* :meth:`~ConversationTurns.start`: the first context (the prompt, or the environment's
  ``reset`` messages rendered with the chat template);
* :meth:`~ConversationTurns.turn_cap`: the new-token cap of its next turn;
* :meth:`~ConversationTurns.end_turn`: records a generated turn (ids and log-probs as
  generated) and says whether its tools should run (:class:`TurnEnd`);
* :meth:`~ConversationTurns.after_tools`: with the turn's tool records, runs the environment
  step, then ends the conversation or appends the tool / observation messages (rendered with
  the chat template, ``chat_render``; masked 0).

A turn ends at a stop token (EOS), at the end of a tool call (``stop_sequences``: the ids of the
tool call format's closing text, e.g. ``</tool_call>``; the turn keeps them) or at its cap. A
turn stopped by its cap or at the end of a call has no end-of-turn token: the chat template's
text closes it (appended, masked 0); only the cap counts as a ``turn_tokens`` cut. The stop
sequence is the closing text tokenized alone: exact where it is one token (Qwen's
``</tool_call>``) or where the tokenizer does not merge it with its neighbours; a turn that
writes it with other ids runs on to EOS, as without the stop.
See ``multi_turn.py`` for the budgets and the batch a rollout returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from parallel_models.rl.agents.chat_render import appended_ids, cap_content
from parallel_models.rl.agents.environment import check_messages, step_result
from parallel_models.rl.agents.executor import ToolExecutor, tool_messages
from parallel_models.rl.agents.tool_call_format import call_end_text

CUTS = ("max_turns", "total_tokens", "turn_tokens", "tool_response")


@dataclasses.dataclass
class MultiTurnLimits:
    """The budgets of a conversation (see ``multi_turn.py``); None: no cap.
    ``stop_at_call_end``: a turn ends at the end of a tool call."""

    max_turns: int = 1
    max_total_tokens: int | None = None
    max_turn_tokens: int | None = None
    max_tool_response_tokens: int | None = None
    stop_at_call_end: bool = True


@dataclasses.dataclass
class Conversation:
    """One sample's state while it is generated."""

    context: list[int]               # prompt + response so far: what the next turn reads
    prompt_length: int
    seed: int | None
    env: Any = None
    messages: list[dict] = dataclasses.field(default_factory=list)
    response: list[int] = dataclasses.field(default_factory=list)
    model_mask: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    tool_trace: list[dict] = dataclasses.field(default_factory=list)
    environment_reward: float | None = None
    turns: int = 0
    done: bool = False
    cuts: set = dataclasses.field(default_factory=set)
    routes: list = dataclasses.field(default_factory=list)  # MoE: per context position

    def add_routes(self, routes: list) -> None:
        """A turn's recorded routes (per position of its context and generated ids): the
        positions not yet known, and the last generated id of the turn before (fed to the model
        first by this turn's prefill); the earlier positions keep the routes they had."""
        keep = max(0, len(self.routes) - 1)
        self.routes = self.routes[:keep] + list(routes[keep:])

    def add(self, ids: Sequence[int], model: bool, log_probs: Sequence[float] = ()) -> None:
        self.context += list(ids)
        self.response += list(ids)
        self.model_mask += [int(model)] * len(ids)
        self.log_probs += list(log_probs) if model else [0.0] * len(ids)


@dataclasses.dataclass
class TurnEnd:
    """A recorded turn: its text and ids, whether it ended on a stop token (``stopped``) and
    whether its tools and environment step run (``spent``: the total budget is used up)."""

    text: str
    ids: list[int]
    stopped: bool
    spent: bool


class ConversationTurns:
    """``ConversationTurns(tokenizer, limits, executor=None, environment=None)``; set
    :attr:`stop_ids` (the engine's stop ids of a turn) before :meth:`end_turn`."""

    def __init__(self, tokenizer, limits: MultiTurnLimits, executor: ToolExecutor | None = None,
                 environment: type | None = None):
        self.tokenizer, self.limits = tokenizer, limits
        self.executor, self.environment = executor, environment
        self.stop_ids: set = set()
        self.stop_sequences: list[list[int]] = []
        end = call_end_text(executor.call_format) if executor is not None else None
        if end and limits.stop_at_call_end:
            self.stop_sequences = [list(tokenizer(end, add_special_tokens=False)["input_ids"])]

    # ---- a conversation's steps ----------------------------------------------------------------
    def start(self, prompt: Sequence[int], seed, record: dict | None) -> Conversation:
        if record is None:  # e.g. validation prompts: the prompt's text only
            record = {"prompt": self.tokenizer.decode(list(prompt), skip_special_tokens=True)}
        env, messages = None, []
        if self.environment is not None:
            env = self.environment()
            messages = check_messages(env.reset(dict(record)) or [], "environment reset()")
        if messages:
            text = self.tokenizer.apply_chat_template(
                messages, tools=self.schemas(), add_generation_prompt=True, tokenize=False)
            prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            messages = [{"role": "user", "content": self.tokenizer.decode(
                list(prompt), skip_special_tokens=True)}]
        return Conversation(context=list(prompt), prompt_length=len(prompt), seed=seed, env=env,
                            messages=list(messages))

    def schemas(self):
        if self.executor is None or not self.executor.tools:
            return None
        return [t.openai_schema() for t in self.executor.tools.values()]

    def turn_cap(self, c: Conversation, max_new_tokens: int) -> int:
        cap = max_new_tokens
        if self.limits.max_turn_tokens is not None:
            cap = min(cap, self.limits.max_turn_tokens)
        if self.limits.max_total_tokens is not None:
            cap = min(cap, self.limits.max_total_tokens - len(c.response))
        return max(1, cap)

    def end_turn(self, c: Conversation, turn: dict) -> TurnEnd:
        """Record ``turn`` (``token_ids``, ``log_probs``) in ``c``."""
        ids = list(turn["token_ids"])
        c.add(ids, model=True, log_probs=turn["log_probs"])
        c.turns += 1
        stopped = bool(ids) and ids[-1] in self.stop_ids
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        c.messages.append({"role": "assistant", "content": text})
        return TurnEnd(text, ids, stopped, self.out_of_total(c, 0, at_limit=True))

    def run_tools(self, end: TurnEnd):
        """A future of the turn's tool records, or None (no executor, or out of budget)."""
        if self.executor is None or end.spent:
            return None
        return self.executor.submit(end.text)

    def after_tools(self, c: Conversation, end: TurnEnd, records) -> float:
        """The turn's tool ``records`` (a list; empty: none ran) and the environment step:
        append the next messages or end ``c``; returns the tools' seconds."""
        if end.spent:  # the turn used what was left of the total budget
            c.cuts.add("total_tokens")
            c.done = True
            return 0.0
        if not end.stopped and not self.ends_call(end.ids):  # cut by its cap
            c.cuts.add("turn_tokens")
        seconds = sum(r.seconds for r in records)
        c.tool_trace += [dict(turn=c.turns, **dataclasses.asdict(r)) for r in records]
        new = self._tool_messages(c, records)
        done = not records
        if c.env is not None:
            result = step_result(c.env.step(end.text, list(end.ids)), "environment")
            if result.reward is not None:
                c.environment_reward = (c.environment_reward or 0.0) + result.reward
            new += result.messages
            done = result.done
        if done:
            c.done = True
            return seconds
        if c.turns >= self.limits.max_turns:
            c.cuts.add("max_turns")
            c.done = True
            return seconds
        stop_text = self.tokenizer.decode([end.ids[-1]]) if end.stopped else None
        ids = appended_ids(self.tokenizer, new, stop_text)
        if self.out_of_total(c, len(ids) + 1):
            c.cuts.add("total_tokens")
            c.done = True
            return seconds
        c.messages += new
        c.add(ids, model=False)
        return seconds

    def ends_call(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` end with the end of a tool call (a stop sequence)."""
        return any(len(ids) >= len(s) and list(ids[len(ids) - len(s):]) == s
                   for s in self.stop_sequences)

    def _tool_messages(self, c: Conversation, records) -> list[dict]:
        messages = tool_messages(records)
        for m in messages:
            m["content"], cut = cap_content(self.tokenizer, m["content"],
                                            self.limits.max_tool_response_tokens)
            if cut:
                c.cuts.add("tool_response")
        return messages

    def out_of_total(self, c: Conversation, more: int = 0, at_limit: bool = False) -> bool:
        """Whether ``more`` tokens would pass the total budget (``at_limit``: or reach it)."""
        total = self.limits.max_total_tokens
        if total is None:
            return False
        return len(c.response) + more >= total if at_limit else len(c.response) + more > total


__all__ = ["CUTS", "Conversation", "ConversationTurns", "MultiTurnLimits", "TurnEnd"]
