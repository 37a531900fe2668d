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

A turn also ends right after the end of a tool call (``</tool_call>`` for the hermes format:
the ids of the format's ``call_end`` text are a stop sequence of the engine; the turn keeps them,
and the chat template's end-of-turn text is appended after it, masked 0), unless
``rollout.multi_turn.stop_at_call_end`` is off.

Two drivers (``conversation.ConversationTurns`` does each conversation's steps for both):

* asynchronous (``async_turns.AsyncTurns``, the default for a
  :class:`~parallel_models.inference.RolloutEngine`): each turn is a request of the continuous
  engine; a row that ends a turn leaves the decode batch (keeping its KV), its tools run in the
  thread pool, and it re-enters with the whole conversation as its prompt, of which only the new
  tokens are prefilled, while the other rows keep decoding;
* turn-synchronous: all live conversations generate a turn together (``generate_samples``),
  then their tools run, then the next turn. It serves engines without a continuous engine (only
  ``generate_samples``) and MoE actors (the static batcher records every token's routes for
  router replay; a position keeps the routes of the first turn that fed it to the model), and is
  the reference the asynchronous driver is tested against (same tokens for the same seeds).
"""


from __future__ import annotations

import time
from typing import Sequence

import torch

from parallel_models.inference import row_seed
from parallel_models.rl.agents.async_turns import (REENTRY_WAIT_STEPS, AsyncTurns,
                                                   supports_async, turn_seed)
from parallel_models.rl.agents.conversation import (CUTS, Conversation, ConversationTurns,
                                                    MultiTurnLimits)
from parallel_models.rl.agents.executor import ToolExecutor
from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.rollout.interface import EngineTokens


class MultiTurnRollout(EngineTokens):
    """``MultiTurnRollout(inner, tokenizer, limits, executor=None, environment=None,
    asynchronous=None, engine=None)``: ``inner`` an in-process rollout (its ``engine``; or
    ``engine`` given, e.g. ``server_turns.ServerTurnEngine`` of a server rollout),
    ``environment`` a class (one instance per conversation); ``asynchronous``: the driver (None:
    asynchronous when the engine supports it). ``generate(..., records=...)`` takes the prompts' dataset records
    (for ``reset``; without them an environment gets ``{"prompt": the prompt's text}``)."""

    takes_records = True

    def __init__(self, inner, tokenizer, limits: MultiTurnLimits,
                 executor: ToolExecutor | None = None, environment: type | None = None,
                 asynchronous: bool | None = None, engine=None):
        self.inner, self.engine = inner, engine if engine is not None else inner.engine
        self.tokenizer, self.limits = tokenizer, limits
        self.executor, self.environment = executor, environment
        self.turns = ConversationTurns(tokenizer, limits, executor, environment)
        self.num_experts = getattr(inner, "num_experts", None)  # MoE: rows carry their routes
        if asynchronous is None:  # (the continuous engine records no routes)
            asynchronous = supports_async(self.engine) and self.num_experts is None
        self.asynchronous = asynchronous
        self.reentry_wait_steps = REENTRY_WAIT_STEPS  # the asynchronous driver's (async_turns)
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
        conversations = [
            self.turns.start(prompt, None if prompt_seeds is None else
                             row_seed(prompt_seeds[i], j), records[i] if records else None)
            for i, prompt in enumerate(prompt_ids) for j in range(n)]
        one = sampling.model_copy(update={"n": 1})
        start = time.monotonic()
        if self.asynchronous:
            driver = AsyncTurns(self.turns, self.engine, self.reentry_wait_steps)
            tool_seconds = driver.run(conversations, one, sampling.max_new_tokens)
            idle_seconds = driver.idle_seconds
        else:
            tool_seconds, idle_seconds = self._turn_synchronous(
                conversations, one, sampling.max_new_tokens, seeded=prompt_seeds is not None)
        batch = self._batch(conversations, len(prompt_ids), n)
        self.metrics = self._metrics(conversations, tool_seconds, idle_seconds,
                                     time.monotonic() - start)
        return batch

    def _turn_synchronous(self, conversations: list[Conversation], one, max_new_tokens: int,
                          seeded: bool) -> tuple[float, float]:
        """Every live conversation's turn in one ``generate_samples``, then their tools (all at
        once, in the executor's pool); returns the tools' seconds and the wall seconds of the
        tools phases (no row decodes meanwhile)."""
        self.turns.stop_ids = set(self.engine.stop_ids(one))
        seconds = idle = 0.0
        while True:
            live = [c for c in conversations if not c.done]
            if not live:
                return seconds, idle
            caps = [self.turns.turn_cap(c, max_new_tokens) for c in live]
            extra = {"stop_sequences": self.turns.stop_sequences} \
                if self.turns.stop_sequences else {}
            if self.num_experts is not None:
                extra["record_routes"] = True
            generated = self.engine.generate_samples(
                [c.context for c in live], one, max_new_tokens=caps,
                prompt_seeds=[turn_seed(c) for c in live] if seeded else None, **extra)
            for c, turn in zip(live, generated):
                if "routes" in turn:
                    c.add_routes(turn["routes"])
            ends = [self.turns.end_turn(c, turn) for c, turn in zip(live, generated)]
            started = time.perf_counter()
            futures = [self.turns.run_tools(end) for end in ends]
            for c, end, future in zip(live, ends, futures):
                records = future.result() if future is not None else []
                seconds += self.turns.after_tools(c, end, records)
            idle += time.perf_counter() - started

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
        if self.num_experts is not None and conversations[0].routes:
            batch.routes = self._routes(conversations, P, R).to(device)
        batch.columns["conversation"] = [c.messages for c in conversations]
        batch.columns["tool_trace"] = [c.tool_trace for c in conversations]
        batch.columns["environment_reward"] = [c.environment_reward for c in conversations]
        return batch

    def _routes(self, conversations: list[Conversation], P: int, R: int) -> torch.Tensor:
        """``[rows, P + R, moe_layers, k]`` (compact) routes aligned with the batch's sequences
        (missing where none was recorded: padding, the last generated id)."""
        from parallel_models.utils import routes as route_utils

        shape = torch.tensor(conversations[0].routes[0]).shape
        full = torch.full((len(conversations), P + R, *shape), route_utils.MISSING,
                          dtype=torch.long)
        for b, c in enumerate(conversations):
            start = P - c.prompt_length
            full[b, start:start + len(c.routes)] = torch.tensor(c.routes, dtype=torch.long)
        return route_utils.compact(full, self.num_experts)

    def _metrics(self, conversations: list[Conversation], tool_seconds: float,
                 idle_seconds: float, seconds: float) -> dict[str, float]:
        rows = max(1, len(conversations))
        calls = [len(c.tool_trace) for c in conversations]
        metrics = {
            "rollout/turns_mean": sum(c.turns for c in conversations) / rows,
            "rollout/tool_calls_mean": sum(calls) / rows,
            "rollout/tool_errors": float(sum(t["error"] for c in conversations
                                             for t in c.tool_trace)),
            "rollout/tool_time_s": tool_seconds,
            "rollout/idle_on_tools_s": idle_seconds,
            "rollout/multi_turn_s": seconds,
        }
        for cut in CUTS:
            metrics[f"rollout/cut_{cut}"] = sum(cut in c.cuts for c in conversations) / rows
        return metrics


__all__ = ["CUTS", "Conversation", "MultiTurnLimits", "MultiTurnRollout"]
