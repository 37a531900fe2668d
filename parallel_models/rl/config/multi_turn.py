"""``rollout.multi_turn``: the settings of multi-turn (agentic) rollouts, a nested section of
``rollout`` (set from the command line as ``rollout.multi_turn.max_turns=3``).

With the defaults (one turn, no tools, no environment) the rollout is the single-turn one,
unchanged; any of ``max_turns > 1``, ``tools`` or ``environment`` turns the multi-turn rollout
on (``parallel_models/rl/agents/multi_turn.py``).
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, Field, StrictBool, field_validator

from parallel_models.rl.config.section_config import SECTION_CONFIG
from parallel_models.utils.optimizer_config import Int, Number


class MultiTurnSection(BaseModel):
    """Conversations of model turns, tool results and environment observations."""

    model_config = SECTION_CONFIG

    max_turns: Int = Field(1, ge=1, description="model turns per conversation at most")
    max_total_tokens: Optional[Int] = Field(
        None, ge=1, description="generated + appended tokens per conversation at most (null: "
                                "max_turns x rollout.max_new_tokens and the tool messages)")
    max_turn_tokens: Optional[Int] = Field(
        None, ge=1, description="generated tokens per turn at most (null: "
                                "rollout.max_new_tokens)")
    max_tool_response_tokens: Optional[Int] = Field(
        None, ge=1, description="tokens of one tool result at most (longer ones are cut)")
    tools: list[str] = Field(default_factory=list, description="tools offered: calculator, "
                             "python, or path/to/file.py:object (a Tool or a function with an "
                             "openai_schema)")
    environment: Optional[str] = Field(
        None, description="path/to/file.py:Env: reset(record) -> messages, step(turn_text, "
                          "turn_ids) -> (messages, reward, done); null: a turn without a tool "
                          "call ends the conversation")
    tool_call_format: str = Field("hermes", description="how tool calls are written: hermes "
                                  "(<tool_call>{json}</tool_call>) or path/to/file.py:parse")
    stop_at_call_end: StrictBool = Field(
        True, description="a model turn ends right after the end of a tool call (the call "
                          "format's closing text, </tool_call> for hermes); off: only at EOS or "
                          "the turn's cap (several calls per turn)")
    tool_timeout_s: Number = Field(30.0, gt=0, description="seconds a tool call may take")
    tool_workers: Int = Field(8, ge=1, description="tool calls running at once")

    @property
    def enabled(self) -> bool:
        """Whether the rollout is multi-turn (anything but the defaults' single turn)."""
        return self.max_turns > 1 or bool(self.tools) or self.environment is not None

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, specs: list[str]) -> list[str]:
        from parallel_models.rl.agents.tools import TOOLS

        for spec in specs:
            problem = TOOLS.problem(spec)
            if problem:
                raise ValueError(problem)
        return specs

    @field_validator("tool_call_format")
    @classmethod
    def _known_format(cls, name: str) -> str:
        from parallel_models.rl.agents.tool_call_format import TOOL_CALL_FORMATS

        problem = TOOL_CALL_FORMATS.problem(name)
        if problem:
            raise ValueError(problem)
        return name


__all__ = ["MultiTurnSection"]
