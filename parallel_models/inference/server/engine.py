"""The model side of the rollout server: the rollout engine on every rank, commands mirrored.

Rank 0 turns a batch of HTTP requests into a list of generate calls, broadcasts the command over
a gloo control group (``broadcast_object_list``) and runs it on its
:class:`~parallel_models.inference.engine.RolloutEngine`; ranks > 0 sit in :func:`worker_loop`
and run the same commands, so the TP collectives inside ``generate`` match. All model work on
rank 0 happens on one thread (the batcher), so a weight update runs between batches: requests
already in a batch finish on the old weights, later ones see the new ones. Weight updates are
atomic across the ranks (the engine's ``update_weights`` with the control group): if any rank
fails to load, every rank keeps its old shard and the version does not move. In continuous mode
(the rollout engine has a KV budget) the command is ``cstep``: new requests + one engine step
(``server/continuous_batcher.py``); with ``--partial-rollouts`` an update lands between two of
its steps and the running rows go on under the new weights (``server/partial_rollout.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch.distributed as dist

from parallel_models.inference.engine import RolloutEngine
from parallel_models.inference.sampling import SamplingParams
from parallel_models.inference.server.partial_rollout import (read_queued_step,
                                                              recompute_running_kv)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GenCall:
    """One generate call: token-id rows (one sample each) sharing sampling params; a seeded
    call's params carry its seed, a call with ``prompt_seeds`` one seed per prompt (its rows
    are prompts x n; ``prompt_caps``: one max_new_tokens per prompt). ``top_logprobs=k`` asks
    for the k most likely tokens per
    step (the OpenAI API's ``logprobs``); ``record_routes`` adds each sample's MoE routes."""

    rows: list[list[int]]
    params: SamplingParams
    top_logprobs: int = 0
    record_routes: bool = False
    prompt_seeds: list[int] | None = None  # the rows are prompts x n, each prompt seeded
    prompt_caps: list[int] | None = None  # per prompt (rows: prompts x n), its max new tokens

    def generate_samples(self, rollout: RolloutEngine, on_step=None) -> list[dict]:
        """The call's samples, one per row, from ``rollout``."""
        rows, params, seeds, caps = self.rows, self.params, self.prompt_seeds, self.prompt_caps
        if seeds is not None:  # n rows per prompt: its samples 0..n-1 (row_seed(seed, j))
            n = len(rows) // len(seeds)
            rows, params = rows[::n], params.model_copy(update={"n": n})
        elif caps is not None:  # one call row per sample: each its prompt's cap
            caps = [c for c in caps for _ in range(len(rows) // len(caps))]
        return rollout.generate_samples(rows, params, self.top_logprobs, on_step,
                                        record_routes=self.record_routes, prompt_seeds=seeds,
                                        max_new_tokens=caps)


class Engine:
    """This rank's :class:`RolloutEngine` plus the command mirroring (the same on every rank)."""

    def __init__(self, rollout: RolloutEngine, tp: int, control_group=None):
        self.rollout = rollout
        self.model = rollout.model
        self.model_path = rollout.weights_path
        self.tp = tp
        self.group = control_group
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.batches = 0
        self.weight_group = None  # the trainer's weights group, once joined (weight_group.py)
        self.pending_join = None  # a join under way on its own thread (weight_group.py)
        self.partial_rollouts = False  # --partial-rollouts: updates land between decode steps

    @property
    def version(self) -> int:
        return self.rollout.version

    @property
    def weights_path(self) -> str | None:
        return self.rollout.weights_path

    @property
    def generated_tokens(self) -> int:
        return self.rollout.generated_tokens

    def continuous_stats(self) -> dict:
        """Continuous mode: the engine's state for ``/info`` (empty otherwise)."""
        c = self.rollout._continuous
        if c is None:
            return {}
        return {"engine_steps": c.steps, "running_rows": len(c.running),
                "waiting_requests": len(c.scheduler.waiting),
                "kv_used_tokens": c.scheduler.pool.used,
                "kv_budget_tokens": c.scheduler.pool.capacity,
                "prompts_prefilled": c.prefilled_prompts,
                "prefix_cache_hits": c.prefixes.hits if c.prefixes is not None else 0}

    # ---- rank 0 side ---------------------------------------------------------------------
    def _broadcast(self, cmd):
        if self.world > 1:
            obj = [cmd]
            dist.broadcast_object_list(obj, src=0, group=self.group)
        return cmd

    def run_generate(self, calls: list[GenCall], on_step: list | None = None
                     ) -> list[list[dict]]:
        """Run ``calls`` on every rank; ``on_step[i]`` (rank 0 only, may be None) sees call i's
        tokens step by step (``generation.generate``)."""
        self._broadcast(("generate", calls))
        return self._do_generate(calls, on_step)

    def run_cstep(self, submissions: list, hooks: list | None = None) -> None:
        """Continuous mode: submit ``submissions`` (``(prompt, params, top_logprobs)``; rank 0's
        ``hooks[i]`` = ``(on_token, on_done)``) and run one engine step, on every rank."""
        self._broadcast(("cstep", submissions))
        self._do_cstep(submissions, hooks)

    def reset_continuous(self) -> None:
        """Drop every running request (after a failed step), on every rank."""
        self._broadcast(("creset",))
        self.rollout._continuous = None

    def update_weights(self, path) -> dict:
        """Load ``path`` (a folder, or pushed weights staged on rank 0: forwarded to the other
        ranks as tensor broadcasts, ``weight_broadcast.py``) on every rank, all or nothing."""
        from parallel_models.inference.server.weight_stream import PushedWeights

        if hasattr(path, "run_on_every_rank"):  # a weights-group join or push (weight_group.py)
            self._broadcast(("group_job", path))
            return path.run_on_every_rank(self)
        if self.world > 1 and isinstance(path, PushedWeights):
            from parallel_models.inference.server.weight_broadcast import NotStaged, send_pushed

            self._broadcast(("update_pushed", path.headers()))
            if not send_pushed(path, self.group):  # a rank had no room: all keep the old weights
                path = NotStaged("another rank could not stage them")
            return self._do_update(path)
        self._broadcast(("update", path))
        return self._do_update(path)

    def stop_workers(self) -> None:
        self._broadcast(("stop",))

    # ---- every rank --------------------------------------------------------------------------
    def _do_generate(self, calls: list[GenCall], on_step: list | None = None
                     ) -> list[list[dict]]:
        self.model.eval()
        on_step = on_step or [None] * len(calls)
        outs = [call.generate_samples(self.rollout, hook) for call, hook in zip(calls, on_step)]
        self.batches += 1
        return outs

    def _do_cstep(self, submissions: list, hooks: list | None = None) -> None:
        engine = self.rollout.continuous_engine()
        self.model.eval()
        for (prompt, params, top_k), (on_token, on_done) in zip(
                submissions, hooks or [(None, None)] * len(submissions)):
            engine.submit(prompt, params, stop_ids=self.rollout.stop_ids(params),
                          top_logprobs=top_k, on_token=on_token, on_done=on_done)
        if engine.has_work:
            engine.step()
            self.batches = engine.steps

    def _do_update(self, path: str) -> dict:
        group = self.group if self.world > 1 else None
        return self.swap_in_flight(lambda: self.rollout.update_weights(path, group=group))

    def swap_in_flight(self, swap) -> dict:
        """``swap()`` (a weight update of this rank) with partial rollouts around it: the rows in
        flight go on under the new weights, their KV recomputed (``partial_rollout.py``); every
        push transport (folder, stream, group) goes through here. It runs where the engine's
        steps run, between two of them: on rank 0 the batcher's thread (an ``update`` job), on
        the other ranks :func:`worker_loop`, in command order."""
        running = self.rollout._continuous if self.partial_rollouts else None
        if running is not None:
            read_queued_step(running)
        answer = swap()
        if running is not None:
            recompute_running_kv(running)
        return answer

    def execute(self, cmd):
        kind = cmd[0]
        if kind == "generate":
            return self._do_generate(cmd[1])
        if kind == "update":
            return self._do_update(cmd[1])
        if kind == "update_pushed":
            from parallel_models.inference.server.weight_broadcast import receive_pushed

            return self._do_update(receive_pushed(cmd[1], self.group))
        if kind == "group_job":
            return cmd[1].run_on_every_rank(self)
        if kind == "cstep":
            return self._do_cstep(cmd[1])
        if kind == "creset":
            self.rollout._continuous = None
            return None
        raise ValueError(f"unknown command {kind!r}")


def make_control_group():
    """A gloo group over all ranks for the command broadcasts; it waits (idle server) ~forever."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


def worker_loop(engine: Engine) -> None:
    """Ranks > 0: run rank 0's commands until it says stop. Errors are logged, not fatal (rank 0
    sees the same error on the same command and reports it)."""
    while True:
        obj = [None]
        dist.broadcast_object_list(obj, src=0, group=engine.group)
        cmd = obj[0]
        if cmd is None or cmd[0] == "stop":
            return
        try:
            engine.execute(cmd)
        except Exception:  # noqa: BLE001 - keep following rank 0
            log.exception("rank %d: command %s failed", dist.get_rank(), cmd[0])
