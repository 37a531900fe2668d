"""The multi-turn rollout: conversations of model turns, tool results and environment
observations, on the in-process engine (``rollout.multi_turn``).

:class:`MultiTurnRollout` wraps an in-process rollout (an adapter with an ``engine`` whose
``generate_samples`` it drives) and satisfies the same
:class:`~parallel_models.rl.rollout.interface.Rollout` interface. Each of the ``n`` samples of a
prompt is a conversation:

1. the context is the prompt's ids (or, with an environment whose ``reset(record)`` gives
   messages, those messages rendered with the chat template and its generation prompt);
2. the model generates one turn (until a stop token, at most ``max_turn_tokens`` and what is left
   of ``max_total_tokens``); its ids and the sampler's log-probs are kept as generated;
3. the turn's tool calls run (``executor.ToolExecutor``: every bad call is an error result),
   then the environment's ``step(turn_text, turn_ids)`` gives observation messages, a reward
   and done; without an environment a turn that calls no tool ends the conversation;
4. the tool and observation messages (each tool result cut to ``max_tool_response_tokens``) are
   rendered with the chat template (``chat_render``: the text suffix after the turn, tokenized
   alone) and appended; the next turn continues from the whole token stream.

A conversation ends when done, after ``max_turns`` model turns (counted as a ``max_turns`` cut
when it was not done), or when ``max_total_tokens`` is spent (``total_tokens``: by a turn, or by
appended messages that would not fit, which are then not appended). A turn that reaches
``max_turn_tokens`` (or ``rollout.max_new_tokens``) without a stop token is counted as a
``turn_tokens`` cut but does not end the conversation: its tools and the environment step run,
and the chat template closes it (the end-of-turn text is appended, masked 0).

The batch: the prompt as the prompt; the response is every generated and appended id in order,
``response_mask`` 1 on generated ids and 0 on appended ones (holes), ``attention_mask`` 1 on
both, ``rollout_log_probs`` the sampler's at generated ids (0 elsewhere). Columns:
``conversation`` (the messages, the model's turns as decoded text), ``tool_trace`` (per call:
turn, name, arguments, result, error, seconds) and ``environment_reward`` (the sum of the
environment's rewards, None without one) for the reward function. :attr:`MultiTurnRollout.metrics`
holds the last generate's ``rollout/...`` metrics.

This first version is turn-synchronous: all live conversations generate a turn together, then
their tools run (in parallel, in the executor's pool), then the next turn. Rows waiting on tools
do not free their decode slot for others yet (the continuous engine would need requests that
pause and resume).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import torch

from parallel_models.inference import row_seed
from parallel_models.rl.agents.chat_render import appended_ids, cap_content
from parallel_models.rl.agents.environment import check_messages, step_result
from parallel_models.rl.agents.executor import ToolExecutor, tool_messages
from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.rollout.interface import EngineTokens

_SEED_MASK = (1 << 62) - 1  # the engine's prompt seeds are in [0, 2^62)
CUTS = ("max_turns", "total_tokens", "turn_tokens", "tool_response")


@dataclasses.dataclass
class MultiTurnLimits:
    """The budgets of a conversation (see the module docstring); None: no cap."""

    max_turns: int = 1
    max_total_tokens: int | None = None
    max_turn_tokens: int | None = None
    max_tool_response_tokens: int | None = None


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

    def add(self, ids: Sequence[int], model: bool, log_probs: Sequence[float] = ()) -> None:
        self.context += list(ids)
        self.response += list(ids)
        self.model_mask += [int(model)] * len(ids)
        self.log_probs += list(log_probs) if model else [0.0] * len(ids)


class MultiTurnRollout(EngineTokens):
    """``MultiTurnRollout(inner, tokenizer, limits, executor=None, environment=None)``:
    ``inner`` an in-process rollout (its ``engine``), ``environment`` a class (one instance per
    conversation). ``generate(..., records=...)`` takes the prompts' dataset records (for
    ``reset``; without them an environment gets ``{"prompt": the prompt's text}``)."""

    takes_records = True

    def __init__(self, inner, tokenizer, limits: MultiTurnLimits,
                 executor: ToolExecutor | None = None, environment: type | None = None):
        self.inner, self.engine = inner, inner.engine
        self.tokenizer, self.limits = tokenizer, limits
        self.executor, self.environment = executor, environment
        self.metrics: dict[str, float] = {}

    @property
    def pushes_weights(self) -> bool:
        return self.inner.pushes_weights

    def update_weights(self, version) -> None:
        self.inner.update_weights(version)

    def release_memory(self) -> None:
        self.inner.release_memory()

    def resume_memory(self) -> None:
        self.inner.resume_memory()

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling, *,
                 max_new_tokens: Sequence[int] | None = None,
                 prompt_seeds: Sequence[int] | None = None,
                 records: Sequence[dict] | None = None) -> RolloutBatch:
        refill = getattr(self.inner, "refill", None)
        if refill is not None and self.inner._filled != self.inner.version:
            refill()
            self.inner._filled = self.inner.version
        n = sampling.n
        conversations = []
        for i, prompt in enumerate(prompt_ids):
            for j in range(n):
                seed = None if prompt_seeds is None else row_seed(prompt_seeds[i], j)
                record = records[i] if records else None
                if record is None:  # e.g. validation prompts: the prompt's text only
                    record = {"prompt": self.tokenizer.decode(list(prompt),
                                                              skip_special_tokens=True)}
                conversations.append(self._start(prompt, seed, record))
        one = sampling.model_copy(update={"n": 1})
        start = time.monotonic()
        tool_seconds = 0.0
        while True:
            live = [c for c in conversations if not c.done]
            if not live:
                break
            caps = [self._turn_cap(c, sampling.max_new_tokens) for c in live]
            turns = self.engine.generate_samples(
                [c.context for c in live], one, max_new_tokens=caps,
                prompt_seeds=None if prompt_seeds is None else
                [row_seed(c.seed, c.turns) & _SEED_MASK for c in live])
            tool_seconds += self._after_turns(live, turns, set(self.engine.stop_ids(one)))
        batch = self._batch(conversations, len(prompt_ids), n)
        self.metrics = self._metrics(conversations, tool_seconds, time.monotonic() - start)
        return batch

    # ---- one conversation ---------------------------------------------------------------------
    def _start(self, prompt: Sequence[int], seed, record: dict) -> Conversation:
        env, messages = None, []
        if self.environment is not None:
            env = self.environment()
            messages = check_messages(env.reset(dict(record)) or [], "environment reset()")
        if messages:
            text = self.tokenizer.apply_chat_template(
                messages, tools=self._schemas(), add_generation_prompt=True, tokenize=False)
            prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            messages = [{"role": "user", "content": self.tokenizer.decode(
                list(prompt), skip_special_tokens=True)}]
        return Conversation(context=list(prompt), prompt_length=len(prompt), seed=seed, env=env,
                            messages=list(messages))

    def _schemas(self):
        if self.executor is None or not self.executor.tools:
            return None
        return [t.openai_schema() for t in self.executor.tools.values()]

    def _turn_cap(self, c: Conversation, max_new_tokens: int) -> int:
        cap = max_new_tokens
        if self.limits.max_turn_tokens is not None:
            cap = min(cap, self.limits.max_turn_tokens)
        if self.limits.max_total_tokens is not None:
            cap = min(cap, self.limits.max_total_tokens - len(c.response))
        return max(1, cap)

    def _after_turns(self, live: list[Conversation], turns: list[dict], stops: set) -> float:
        """Record each live conversation's new turn, run its tools and environment step, append
        their messages or end it; returns the tools' seconds."""
        texts = []
        for c, turn in zip(live, turns):
            ids = turn["token_ids"]
            c.add(ids, model=True, log_probs=turn["log_probs"])
            c.turns += 1
            stopped = bool(ids) and ids[-1] in stops
            text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
            c.messages.append({"role": "assistant", "content": text})
            texts.append((text, stopped, self._out_of_total(c, 0, at_limit=True)))
        # every turn's tools at once (a conversation out of budget runs none)
        futures = [self.executor.submit(text) if self.executor is not None and not spent
                   else None for text, _, spent in texts]
        seconds = 0.0
        for c, turn, (text, stopped, spent), future in zip(live, turns, texts, futures):
            if spent:  # the turn used what was left of the total budget
                c.cuts.add("total_tokens")
                c.done = True
                continue
            if not stopped:  # cut at max_turn_tokens: the template closes it (0-masked)
                c.cuts.add("turn_tokens")
            records = future.result() if future is not None else []
            seconds += sum(r.seconds for r in records)
            c.tool_trace += [dict(turn=c.turns, **dataclasses.asdict(r)) for r in records]
            new = self._tool_messages(c, records)
            done = not records
            if c.env is not None:
                result = step_result(c.env.step(text, list(turn["token_ids"])),
                                     "environment")
                if result.reward is not None:
                    c.environment_reward = (c.environment_reward or 0.0) + result.reward
                new += result.messages
                done = result.done
            if done:
                c.done = True
                continue
            if c.turns >= self.limits.max_turns:
                c.cuts.add("max_turns")
                c.done = True
                continue
            stop_text = self.tokenizer.decode([turn["token_ids"][-1]]) if stopped else None
            ids = appended_ids(self.tokenizer, new, stop_text)
            if self._out_of_total(c, len(ids) + 1):
                c.cuts.add("total_tokens")
                c.done = True
                continue
            c.messages += new
            c.add(ids, model=False)
        return seconds

    def _tool_messages(self, c: Conversation, records) -> list[dict]:
        messages = tool_messages(records)
        for m in messages:
            m["content"], cut = cap_content(self.tokenizer, m["content"],
                                            self.limits.max_tool_response_tokens)
            if cut:
                c.cuts.add("tool_response")
        return messages

    def _out_of_total(self, c: Conversation, more: int = 0, at_limit: bool = False) -> bool:
        """Whether ``more`` tokens would pass the total budget (``at_limit``: or reach it)."""
        total = self.limits.max_total_tokens
        if total is None:
            return False
        return len(c.response) + more >= total if at_limit else len(c.response) + more > total

    # ---- the batch and the metrics ------------------------------------------------------------
    def _batch(self, conversations: list[Conversation], prompts: int, n: int) -> RolloutBatch:
        pad = self.engine.pad_token_id
        P = max(c.prompt_length for c in conversations)
        R = max(1, max(len(c.response) for c in conversations))
        rows = len(conversations)
        sequences = torch.full((rows, P + R), pad, dtype=torch.long)
        attention = torch.zeros((rows, P + R), dtype=torch.long)
        mask = torch.zeros((rows, R), dtype=torch.long)
        log_probs = torch.zeros((rows, R), dtype=torch.float32)
        for b, c in enumerate(conversations):
            prompt = c.context[:c.prompt_length]
            sequences[b, P - len(prompt):P] = torch.tensor(prompt)
            attention[b, P - len(prompt):P + len(c.response)] = 1
            k = len(c.response)
            if k:
                sequences[b, P:P + k] = torch.tensor(c.response)
                mask[b, :k] = torch.tensor(c.model_mask)
                log_probs[b, :k] = torch.tensor(c.log_probs, dtype=torch.float32)
        device = self.engine.device
        batch = RolloutBatch(sequences=sequences.to(device), attention_mask=attention.to(device),
                             prompt_lengths=torch.tensor([c.prompt_length for c in
                                                          conversations]).to(device),
                             response_mask=mask.to(device),
                             group_index=torch.arange(prompts).repeat_interleave(n).to(device),
                             rollout_log_probs=log_probs.to(device))
        batch.columns["conversation"] = [c.messages for c in conversations]
        batch.columns["tool_trace"] = [c.tool_trace for c in conversations]
        batch.columns["environment_reward"] = [c.environment_reward for c in conversations]
        return batch

    def _metrics(self, conversations: list[Conversation], tool_seconds: float,
                 seconds: float) -> dict[str, float]:
        rows = max(1, len(conversations))
        calls = [len(c.tool_trace) for c in conversations]
        metrics = {
            "rollout/turns_mean": sum(c.turns for c in conversations) / rows,
            "rollout/tool_calls_mean": sum(calls) / rows,
            "rollout/tool_errors": float(sum(t["error"] for c in conversations
                                             for t in c.tool_trace)),
            "rollout/tool_time_s": tool_seconds,
            "rollout/multi_turn_s": seconds,
        }
        for cut in CUTS:
            metrics[f"rollout/cut_{cut}"] = sum(cut in c.cuts for c in conversations) / rows
        return metrics


__all__ = ["CUTS", "Conversation", "MultiTurnLimits", "MultiTurnRollout"]
