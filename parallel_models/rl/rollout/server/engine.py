"""The model side of the rollout server: one engine per rank, commands mirrored to every rank.

Rank 0 turns a batch of HTTP requests into a list of ``generate`` calls, broadcasts the command
over a gloo control group (``broadcast_object_list``) and runs it; ranks > 0 sit in
:func:`worker_loop` and run the same commands, so the TP collectives inside ``generate`` match.
All model work on rank 0 happens on one thread (the batcher), so a weight update runs between
batches: requests already in a batch finish on the old weights, later ones see the new ones.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time

import torch
import torch.distributed as dist

from parallel_models.rl.rollout.generation import SamplingParams, generate

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GenCall:
    """One ``generate`` call: token-id rows sharing sampling params (and an optional seed)."""

    rows: list[list[int]]
    params: dict
    seed: int | None = None


def _sample_lists(out, params: SamplingParams) -> list[dict]:
    stops = set(params.stop_ids())
    res = []
    mask = out.response_mask.cpu()
    toks = out.responses.cpu()
    logps = out.log_probs.float().cpu()
    for b in range(toks.shape[0]):
        n = int(mask[b].sum())
        ids = toks[b, :n].tolist()
        res.append({"token_ids": ids, "log_probs": logps[b, :n].tolist(),
                    "finish_reason": "stop" if ids and ids[-1] in stops else "length"})
    return res


class Engine:
    """Holds this rank's model shard and executes commands (the same on every rank)."""

    def __init__(self, model, model_path: str, tp: int, control_group=None):
        self.model = model
        self.model_path = model_path
        self.weights_path = model_path
        self.tp = tp
        self.version = 0
        self.group = control_group
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = model.device
        self.generated_tokens = 0
        self.batches = 0

    # ---- rank 0 side ---------------------------------------------------------------------
    def _broadcast(self, cmd):
        if self.world > 1:
            obj = [cmd]
            dist.broadcast_object_list(obj, src=0, group=self.group)
        return cmd

    def run_generate(self, calls: list[GenCall]) -> list[list[dict]]:
        self._broadcast(("generate", calls))
        return self._do_generate(calls)

    def update_weights(self, path: str) -> dict:
        self._broadcast(("update", path))
        return self._do_update(path)

    def stop_workers(self) -> None:
        self._broadcast(("stop",))

    # ---- every rank --------------------------------------------------------------------------
    def _do_generate(self, calls: list[GenCall]) -> list[list[dict]]:
        outs = []
        self.model.eval()
        for call in calls:
            params = SamplingParams(**call.params)
            gen = None
            if call.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(int(call.seed))
            out = generate(self.model, call.rows, params, generator=gen)
            samples = _sample_lists(out, params)
            self.generated_tokens += sum(len(s["token_ids"]) for s in samples)
            outs.append(samples)
        self.batches += 1
        return outs

    def _do_update(self, path: str) -> dict:
        from parallel_models.llama.checkpoint_utils.loader import load_hf_weights

        t0 = time.perf_counter()
        load_hf_weights(self.model, path)
        self.version += 1
        self.weights_path = path
        return {"weight_version": self.version, "path": path,
                "seconds": round(time.perf_counter() - t0, 3)}

    def execute(self, cmd):
        kind = cmd[0]
        if kind == "generate":
            return self._do_generate(cmd[1])
        if kind == "update":
            return self._do_update(cmd[1])
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
