"""The rollout backends by name (``rollout.backend``): each entry builds a
:class:`~parallel_models.rl.rollout.interface.Rollout` from a :class:`RolloutContext` (what the
training backend built: the actor, its model, the special tokens, its own in-process rollout).

Built in: ``inprocess`` (the training backend's own engine in the trainer's processes: the
megatron backend's engine on the actor's weights or the hybrid engine, the fsdp backend's
refilled engine or HF generation) and ``server`` (the HTTP rollout server,
``rl/rollout/server.py``). A user adds one before the config is loaded::

    from parallel_models.rl.rollout.registry import ROLLOUT_BACKENDS
    ROLLOUT_BACKENDS.add("mine", my_factory)   # my_factory(context) -> a Rollout

``rollout.backend`` is checked against this registry when the config is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from parallel_models.rl.registry import Registry


@dataclasses.dataclass
class RolloutContext:
    """What a rollout backend's factory gets from the training backend."""

    cfg: Any                      # the PPO config (its ``rollout`` section, ``trainer.seed``...)
    actor: Any                    # the actor role
    model: Any                    # the actor as our parallel CausalLM (None if it is not one)
    eos_token_id: Any             # the actor tokenizer's EOS (an id or a list)
    pad_token_id: int
    device: Any                   # where the trainer's batches live
    data_parallel_rank: int
    num_experts: int | None       # an MoE actor whose rollouts carry routes, else None
    inprocess: Callable[[], Any]  # the training backend's own in-process rollout
    tokenizer: Any = None         # the actor's tokenizer (multi-turn rollouts render with it)
    model_path: Any = None        # the actor's model folder (an async run's server starts on it)


def inprocess_rollout(context: RolloutContext):
    """``rollout.backend=inprocess``: the training backend's own engine."""
    return context.inprocess()


ROLLOUT_BACKENDS = Registry("rollout backend", key="rollout.backend", user_functions=False,
                            home="parallel_models.rl.rollout.registry.ROLLOUT_BACKENDS")
ROLLOUT_BACKENDS.add("inprocess", inprocess_rollout)
ROLLOUT_BACKENDS.add("server", "parallel_models.rl.rollout.server:server_from_context")


def build_rollout(context: RolloutContext):
    """The rollout of ``context.cfg.rollout.backend``, checked against the interface."""
    from parallel_models.rl.rollout.interface import Rollout

    name = context.cfg.rollout.backend
    if getattr(context.cfg.trainer, "mode", "sync") == "async":  # rl/async_rollout/
        from parallel_models.rl.async_rollout.rollout import async_server_rollout

        rollout = async_server_rollout(context)
    else:
        rollout = ROLLOUT_BACKENDS.get(name)(context)
    multi_turn = getattr(context.cfg.rollout, "multi_turn", None)
    if multi_turn is not None and multi_turn.enabled:  # conversations (rl/agents/)
        from parallel_models.rl.agents.build import multi_turn_rollout

        rollout = multi_turn_rollout(rollout, context.cfg, context.tokenizer)
    if not isinstance(rollout, Rollout):
        raise TypeError(f"rollout.backend={name!r} built {type(rollout).__name__}, which lacks "
                        "the rollout interface (pushes_weights, generate, update_weights, "
                        "release_memory, resume_memory; rl/rollout/interface.py)")
    return rollout


__all__ = ["ROLLOUT_BACKENDS", "RolloutContext", "build_rollout", "inprocess_rollout"]
