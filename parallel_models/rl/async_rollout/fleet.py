"""The rollout server of an async run: ``rollout.server_url`` when given, else one server
process (``parallel-models-serve``) that the trainer's first rank starts on the actor's model
folder, sized for the run's requests, stopped when the run ends (or its process exits).
"""

from __future__ import annotations

import atexit
import logging
import os

import torch.distributed as dist

from parallel_models import inference

logger = logging.getLogger(__name__)



def server_options(cfg) -> tuple[str, ...]:
    """Command-line limits of the server that fit every request of the run (and
    ``--partial-rollouts`` with ``rollout.partial``; its KV pool ``rollout.kv_budget_tokens``
    when set: a token count, or auto = planned from the server GPU's memory; in e4m3 with
    ``rollout.kv_cache_dtype=fp8``)."""
    r = cfg.rollout
    rows = cfg.data.batch_size * r.n
    budget = r.kv_budget_tokens
    return ("--max-batch", str(max(64, rows)), "--max-n", str(max(16, r.n)),
            "--max-new-tokens", str(r.max_new_tokens),
            "--max-prompt-tokens", str(max(1024, cfg.data.max_prompt_length)),
            "--dtype", cfg.model.dtype) + (("--partial-rollouts",) if r.partial else ()) + (
                ("--kv-budget-tokens", str(budget)) if budget else ()) + (
                ("--kv-cache-dtype", "fp8") if r.kv_cache_dtype == "fp8" else ())


class RolloutFleet:
    """The server's base URL (``url``) and, when this process started it, its handle."""

    def __init__(self, url: str, process=None):
        self.url, self.process = url, process
        if process is not None:
            atexit.register(self.stop)

    def stop(self) -> None:
        if self.process is not None:
            inference.stop_server(self.process)
            self.process = None


def rollout_fleet(cfg, model_path: str | None) -> RolloutFleet:
    """Every rank calls: the fleet at ``rollout.server_url``, or a server rank 0 starts on
    ``model_path`` (its log: ``trainer.output_dir/rollout_server.log``; on CUDA the devices of
    ``rollout.server_devices``; it goes when this process does, killed or not), its URL shared
    with every rank."""
    if cfg.rollout.server_url:
        return RolloutFleet(cfg.rollout.server_url)
    from parallel_models.distributed import free_port

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    process, url = None, None
    if rank0:
        if model_path is None:
            raise ValueError("trainer.mode=async without rollout.server_url: the rollout "
                             "backend has no model folder to start the server on")
        port = free_port()
        extra = {}
        if cfg.rollout.server_devices is not None:
            extra["env"] = {"CUDA_VISIBLE_DEVICES": cfg.rollout.server_devices}
        log_path = os.path.join(cfg.trainer.output_dir, "rollout_server.log")
        process = inference.start_server(
            model_path, port, extra=server_options(cfg), log_path=log_path,
            api_key=os.environ.get("PARALLEL_MODELS_API_KEY"), timeout=600.0,
            die_with_parent=True, **extra)
        url = f"http://127.0.0.1:{port}"
        logger.info("trainer.mode=async: rollout server at %s (log %s)", url, log_path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [url]
        dist.broadcast_object_list(box, src=0)
        url = box[0]
    return RolloutFleet(url, process)


__all__ = ["RolloutFleet", "rollout_fleet", "server_options"]
