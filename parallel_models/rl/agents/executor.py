"""Running a model turn's tool calls: parse, check, run in a thread pool, never raise.

:class:`ToolExecutor` parses a turn (the configured tool call format), checks each call (known
tool, arguments valid against its schema) and runs the valid ones in a thread pool, all calls
of a turn at once. Every failure -- a call that is not valid JSON, an unknown tool, wrong
arguments, a tool that raises (the sandbox's limits included), a call still running after
``timeout_s`` -- becomes a :class:`ToolCallRecord` with ``error=True`` and the message the model
reads as the tool result; nothing is raised to the rollout. :meth:`ToolExecutor.submit` returns
a future of the records, so a caller can keep decoding other rows while tools run.

A call past ``timeout_s`` is answered with a timeout error at once, but its thread cannot be
stopped: it runs on in the pool (the ``python`` tool stops its own process at its wall-clock
limit; a user's tool should bound its own time).

:func:`tool_messages` renders the records as chat messages (``role: tool``), and
:func:`tool_metrics` sums what the rollout reports (calls, errors, seconds).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Sequence

from parallel_models.rl.agents.schema import Tool, argument_errors
from parallel_models.rl.agents.tool_call_format import ParsedCall, parse_tool_calls


@dataclass
class ToolCallRecord:
    """One call of a turn and its outcome: ``result`` is what the model reads next."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    result: str = ""
    error: bool = False
    seconds: float = 0.0


class ToolExecutor:
    """``ToolExecutor(tools, *, timeout_s=30, max_workers=8, call_format="hermes",
    max_calls_per_turn=8)``: ``tools`` is ``{name: Tool}``."""

    def __init__(self, tools: dict[str, Tool], *, timeout_s: float = 30.0,
                 max_workers: int = 8, call_format: str = "hermes",
                 max_calls_per_turn: int = 8):
        self.tools = dict(tools)
        self.timeout_s = float(timeout_s)
        self.call_format = call_format
        self.max_calls_per_turn = int(max_calls_per_turn)
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="tool-call")
        self._turns = ThreadPoolExecutor(max_workers=max_workers,
                                         thread_name_prefix="tool-turn")

    def parse(self, turn_text: str) -> list[ParsedCall]:
        return parse_tool_calls(turn_text, self.call_format)

    def run_turn(self, turn_text: str) -> list[ToolCallRecord]:
        """The records of every call in ``turn_text`` (empty: the turn calls no tool)."""
        calls = self.parse(turn_text)
        started = [(call, time.monotonic(), self._start(call))
                   for call in calls[:self.max_calls_per_turn]]
        records = [self._finish(call, start, future) for call, start, future in started]
        for call in calls[self.max_calls_per_turn:]:
            records.append(ToolCallRecord(call.name, call.arguments, error=True, result=(
                f"error: more than {self.max_calls_per_turn} tool calls in one turn; this "
                "one was not run")))
        return records

    def submit(self, turn_text: str) -> Future:
        """:meth:`run_turn` in the background: a future of its records."""
        return self._turns.submit(self.run_turn, turn_text)

    def close(self) -> None:
        self._turns.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self, call: ParsedCall) -> Future | str:
        """A future of the tool's result, or the error message of a call that cannot run."""
        if call.error:
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return (f"error: unknown tool {call.name!r}; available: "
                    f"{', '.join(sorted(self.tools)) or 'none'}")
        problems = argument_errors(tool.parameters, call.arguments)
        if problems:
            return f"error: wrong arguments for {call.name!r}: " + "; ".join(problems)
        return self._pool.submit(tool.run, **call.arguments)

    def _finish(self, call: ParsedCall, start: float, future: Future | str) -> ToolCallRecord:
        record = ToolCallRecord(call.name, call.arguments)
        if isinstance(future, str):
            record.result, record.error = future, True
        else:
            left = max(0.0, self.timeout_s - (time.monotonic() - start))
            try:
                result = future.result(timeout=left)
                record.result = result if isinstance(result, str) else json.dumps(result)
            except FutureTimeout:
                record.result = (f"error: {call.name!r} did not finish within "
                                 f"{self.timeout_s:g} s")
                record.error = True
            except Exception as err:  # noqa: BLE001 - a tool's failure is the model's result
                record.result, record.error = f"error: {err}", True
        record.seconds = time.monotonic() - start
        return record


def tool_messages(records: Sequence[ToolCallRecord]) -> list[dict]:
    """The chat messages (``role: tool``) that answer ``records``, in call order."""
    return [{"role": "tool", "name": r.name, "content": r.result} for r in records]


def tool_metrics(records: Sequence[ToolCallRecord]) -> dict[str, float]:
    """``calls``, ``errors`` and ``seconds`` (summed) of ``records``."""
    return {"calls": float(len(records)), "errors": float(sum(r.error for r in records)),
            "seconds": float(sum(r.seconds for r in records))}


__all__ = ["ToolCallRecord", "ToolExecutor", "tool_messages", "tool_metrics"]
