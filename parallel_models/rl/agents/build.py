"""Building the multi-turn rollout from the config (``rollout.multi_turn``): the tools, the
executor, the environment class and the budgets, around the training backend's in-process
rollout (or the rollout server's: ``server_turns``). :func:`multi_turn_rollout` is the hook
``rl/rollout/registry.build_rollout`` calls when ``rollout.multi_turn`` is on."""

from __future__ import annotations

from parallel_models.errors import ConfigError
from parallel_models.rl.agents.environment import load_environment
from parallel_models.rl.agents.executor import ToolExecutor
from parallel_models.rl.agents.multi_turn import MultiTurnLimits, MultiTurnRollout
from parallel_models.rl.agents.server_turns import ServerTurnEngine
from parallel_models.rl.agents.tools import resolve_tools


def multi_turn_rollout(rollout, cfg, tokenizer) -> MultiTurnRollout:
    """``rollout`` (an in-process adapter) as a :class:`MultiTurnRollout` of
    ``cfg.rollout.multi_turn``; ConfigError for a rollout it cannot drive."""
    mt = cfg.rollout.multi_turn
    engine = getattr(rollout, "engine", None)
    if not callable(getattr(engine, "generate_samples", None)):
        if getattr(rollout, "client", None) is None:
            raise ConfigError(f"rollout.multi_turn needs an in-process rollout engine "
                              f"(rollout.backend=inprocess) or the rollout server "
                              f"(rollout.backend=server); rollout.backend="
                              f"{cfg.rollout.backend!r} built {type(rollout).__name__}, which "
                              f"has neither")
        engine = ServerTurnEngine(rollout)  # turns as /generate requests
    if tokenizer is None:
        raise ConfigError("rollout.multi_turn needs the actor's tokenizer")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("rollout.multi_turn: the actor's tokenizer has no chat template to "
                          "render tool and environment messages with")
    tools = resolve_tools(mt.tools)
    executor = None
    if tools:
        executor = ToolExecutor(tools, timeout_s=mt.tool_timeout_s, max_workers=mt.tool_workers,
                                call_format=mt.tool_call_format)
    environment = load_environment(mt.environment) if mt.environment else None
    limits = MultiTurnLimits(max_turns=mt.max_turns, max_total_tokens=mt.max_total_tokens,
                             max_turn_tokens=mt.max_turn_tokens,
                             max_tool_response_tokens=mt.max_tool_response_tokens,
                             stop_at_call_end=mt.stop_at_call_end)
    return MultiTurnRollout(rollout, tokenizer, limits, executor=executor,
                            environment=environment, engine=engine)


__all__ = ["multi_turn_rollout"]
