"""PPO trainer checkpoints: save, find the latest, check and resume, at any TP/PP/DP layout.

A checkpoint is a folder ``<output_dir>/checkpoints/step_NNNNNN/``:

- ``dist/``: one megatron-core ``dist_checkpointing`` checkpoint of every trainable role (actor,
  critic): weights and megatron optimizer states (Adam ``exp_avg`` / ``exp_avg_sq``, the fp32
  main params of bf16 models, the shared step) as sharded tensors under the role's prefix
  (``rl/roles/sharded_state.py``), so it loads at another TP/PP/DP layout.
- ``trainer_state.json``: step, LR schedulers, data loader position, KL coefficient, metrics
  position, the layout and the model shapes it was saved with. No pickles.
- ``rng/rank_NNNNN.json``: each rank's torch / CUDA / numpy / Python RNG states.
- ``config.yaml``: the resolved run config.
- ``checksums.json``: size and CRC32 of every file (``llama/checkpoint_utils/checksums.py``), verified
  before a resume loads anything.

Finding and checking the folder to resume (``latest``, ``--resume-fallback``):
``rl/checkpoint_lookup.py``.

Saves are atomic: every rank writes into a hidden temporary sibling, which rank 0 renames once
all ranks have finished; then the ``latest`` file of ``checkpoints/`` names the new folder. A resume
checks the folder (complete, ours, the same model shapes) on every rank before it loads anything,
loads into fresh tensors, and only then replaces the weights, optimizer states and trainer state.
"""

from __future__ import annotations

import base64
import glob
import json
import logging
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from parallel_models.rl.checkpoint_lookup import (  # noqa: F401  (re-exported)
    CONFIG_FILE, DIST_DIR, FORMAT, LATEST_FILE, RNG_DIR, STATE_FILE, TrainerCheckpointError, checkpoint_root,
    choose_checkpoint, latest_checkpoint, newest_checkpoint_candidate, read_checkpoint_state,
    save_failed)
from parallel_models.llama.checkpoint_utils.checksums import write_manifest
from parallel_models.rl.roles import sharded_state
from parallel_models.utils.fault_points import fault_point

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _layout() -> dict:
    return {"tensor_parallel_size": mpu.get_tensor_model_parallel_world_size(),
            "pipeline_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": mpu.get_data_parallel_world_size(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1}


def _position() -> dict:
    return {"rank": _rank(), "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "pp_rank": mpu.get_pipeline_model_parallel_rank(),
            "dp_rank": mpu.get_data_parallel_rank()}


def _backend(trainer) -> str:
    return getattr(trainer.cfg.parallel, "backend", "megatron")


def _model_shape(model) -> dict:
    if not hasattr(model, "head_kind"):  # a transformers model (fsdp backend)
        from parallel_models.rl.backends.fsdp.checkpoint import model_shape

        return model_shape(model)
    c = model.config
    return {"head_kind": model.head_kind, "num_layers": c.num_layers,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size,
            **({"num_experts": c.num_experts, "moe_intermediate_size": c.moe_intermediate_size,
                "moe_layer_ids": list(c.moe_layer_ids)} if c.is_moe else {})}


# ---- RNG states as JSON ---------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """This process's RNG states (torch, CUDA, numpy, Python) as JSON-able values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    out = {"torch": _b64(torch.get_rng_state()),
           "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                     "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
           "python": {"version": version, "state": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        out["cuda"] = _b64(torch.cuda.get_rng_state())
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


# ---- files ------------------------------------------------------------------------------------------
def _write_json(path: str, data) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _make_readable(folder: str) -> None:
    """Checkpoint files readable by group and others (0644 files, 0755 folders)."""
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


def _roles(trainer) -> dict:
    return {name: ([role.model], role.state.optimizer)
            for name, role in trainer._trainable().items()}


def save_trainer_checkpoint(trainer) -> str:
    """Write ``checkpoints/step_N`` (call on every rank); returns its path."""
    from parallel_models.llama.checkpoint_utils.collective_save import publish_or_raise
    from parallel_models.llama.checkpoint_utils.output_dir import temp_dir_for

    root = checkpoint_root(trainer.cfg.trainer.output_dir)
    final = os.path.join(root, f"step_{trainer.step_index:06d}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tag = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
    dist.broadcast(tag, src=0)
    tmp = temp_dir_for(final, f"{int(tag.item()):x}")
    rank = _rank()
    if rank == 0:
        for stale in glob.glob(os.path.join(root, ".step_*.tmp-*")):  # saves cut by a kill
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(os.path.join(tmp, DIST_DIR))
        os.makedirs(os.path.join(tmp, RNG_DIR))
    dist.barrier()
    fault_point("save:temp_created")
    failure = None
    try:
        if _backend(trainer) == "fsdp":
            from parallel_models.rl.backends.fsdp import checkpoint as fsdp_checkpoint

            fsdp_checkpoint.save_roles(os.path.join(tmp, DIST_DIR), trainer._trainable())
        else:
            sharded_state.save_roles(os.path.join(tmp, DIST_DIR), _roles(trainer))
        fault_point("save:after_tensor_data")
        _write_json(os.path.join(tmp, RNG_DIR, f"rank_{rank:05d}.json"),
                    {**_position(), "rng": rng_state()})
        if rank == 0:
            roles = trainer._trainable()
            _write_json(os.path.join(tmp, STATE_FILE), {
                "format": FORMAT, "backend": _backend(trainer), "step": trainer.step_index,
                "total_steps": trainer.cfg.trainer.total_steps,
                "kl_coef": float(trainer.kl_ctrl.value),
                "loader": trainer.loader.state_dict(),
                "metrics_step": trainer.step_index,
                "schedulers": {n: r.state.scheduler.state_dict() for n, r in roles.items()},
                "models": {n: _model_shape(r.model) for n, r in roles.items()},
                "layout": _layout()})
            trainer.cfg.save(os.path.join(tmp, CONFIG_FILE))
    except BaseException as err:  # noqa: BLE001
        failure = err
    if sharded_state.all_ranks_ok(failure is None) and rank == 0:  # every rank has written
        try:
            write_manifest(tmp)
            _make_readable(tmp)
        except OSError as err:
            failure = err
    fault_point("save:before_rename")
    try:
        publish_or_raise(tmp, final, True, failure, device, rank, "trainer checkpoint")
    except BaseException as err:  # noqa: BLE001  (disk full, a failed write: one clear message)
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise save_failed(final, tmp, err) from err
    if rank == 0:
        fault_point("save:after_rename_before_latest")
        _write_json(os.path.join(root, LATEST_FILE), {"latest": os.path.basename(final),
                                                      "step": trainer.step_index})
        os.chmod(os.path.join(root, LATEST_FILE), 0o644)
        fault_point("save:after_latest_before_prune")
        prune_checkpoints(root, trainer.cfg.trainer.max_checkpoints, keep=final)
    dist.barrier()
    return final


def prune_checkpoints(root: str, max_checkpoints: int | None, keep: str) -> list[str]:
    """Delete all but the newest ``max_checkpoints`` complete ``step_N`` folders (never ``keep``,
    the one ``latest`` names); returns the deleted paths. None keeps everything."""
    if not max_checkpoints:
        return []
    steps = sorted((int(m.group(1)), d) for d in glob.glob(os.path.join(root, "step_*"))
                   if (m := _STEP_DIR.match(os.path.basename(d))))
    doomed = [d for _, d in steps[:-max_checkpoints] if os.path.abspath(d) != os.path.abspath(keep)]
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def _check_compatible(path: str, state: dict, trainer, sharded: dict | None) -> None:
    saved_backend = state.get("backend", "megatron")
    if saved_backend != _backend(trainer):
        raise TrainerCheckpointError(
            f"{path}: saved by the {saved_backend} backend, this run uses parallel.backend="
            f"{_backend(trainer)} (their model and optimizer states are stored differently)")
    roles = trainer._trainable()
    saved_roles = set(state.get("models", {}))
    if saved_roles != set(roles):
        raise TrainerCheckpointError(
            f"{path}: saved with trainable roles {sorted(saved_roles)}, this run has "
            f"{sorted(roles)} (critic on/off must match)")
    for name, role in roles.items():
        mine, saved = _model_shape(role.model), state["models"][name]
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if diff:
            raise TrainerCheckpointError(
                f"{path}: the {name} was saved with another model shape: "
                + ", ".join(f"{k} {a} in the checkpoint vs {b} here" for k, (a, b) in diff.items()))
    stored = state["_tensors"]
    if sharded is None:  # fsdp: torch.distributed.checkpoint checks the shapes as it loads
        return
    for key, shape in sharded_state.global_shapes(sharded).items():
        if key not in stored:
            raise TrainerCheckpointError(f"{path}: the checkpoint has no tensor {key!r}")
        if tuple(stored[key]) != shape:
            raise TrainerCheckpointError(
                f"{path}: {key!r} has shape {list(stored[key])} in the checkpoint, this model "
                f"needs {list(shape)} (a checkpoint of another model shape)")


def _rng_for_this_rank(path: str, state: dict) -> dict | None:
    """The RNG states to restore: this rank's own at the same layout, else those of the saved
    rank with this data-parallel index (sampling agrees within a TP group); None if none."""
    me = _position()
    if state["layout"] == _layout():
        file = os.path.join(path, RNG_DIR, f"rank_{me['rank']:05d}.json")
        with open(file) as f:
            return json.load(f)["rng"]
    for file in sorted(glob.glob(os.path.join(path, RNG_DIR, "rank_*.json"))):
        with open(file) as f:
            saved = json.load(f)
        if saved["dp_rank"] == me["dp_rank"] and saved["tp_rank"] == 0 and saved["pp_rank"] == 0:
            return saved["rng"]
    return None


def _forget(empty: list) -> None:
    """Drop the zero optimizer states a failed load declared (the optimizer is as before)."""
    for opt, param in empty:
        opt.state.pop(param, None)


class _MegatronStates:
    """Resume I/O of the megatron backend: megatron-core sharded state dicts."""

    def __init__(self, trainer):
        self.roles = _roles(trainer)

    def empty(self):
        return sharded_state.empty_optimizer_states(self.roles)

    def declare(self):
        return sharded_state.roles_sharded_state_dict(self.roles, loading=True)

    forget = staticmethod(_forget)

    def load(self, folder, sharded):
        return sharded_state.load_roles(folder, sharded)

    def apply(self, loaded):
        sharded_state.apply_loaded(self.roles, loaded)


class _FSDPStates:
    """Resume I/O of the fsdp backend: torch.distributed.checkpoint state dicts."""

    def __init__(self, trainer):
        from parallel_models.rl.backends.fsdp import checkpoint as fsdp_checkpoint

        self.io, self.roles = fsdp_checkpoint, trainer._trainable()

    def empty(self):
        return self.io.empty_optimizers(self.roles)

    def declare(self):
        return None  # declared (and its zero optimizer states made) at load time

    def forget(self, empty):
        self.io.forget(empty)

    def load(self, folder, _):
        return self.io.load_roles(folder, self.io.state_for_loading(self.roles))

    def apply(self, loaded):
        self.io.apply_loaded(self.roles, loaded)


def resume_trainer(trainer, path: str | None = None) -> str | None:
    """Load ``path`` (default: the latest checkpoint) into ``trainer`` on every rank; returns the
    folder, or None when there is no checkpoint (a fresh start)."""
    root = checkpoint_root(trainer.cfg.trainer.output_dir)
    path = choose_checkpoint(root, path, getattr(trainer.cfg.trainer, "resume_fallback", False))
    if path is None:
        logger.warning("resume requested but no checkpoint in %s; starting fresh", root)
        return None
    error = None
    io = _FSDPStates(trainer) if _backend(trainer) == "fsdp" else _MegatronStates(trainer)
    empty = io.empty()
    try:
        state = read_checkpoint_state(path)
        sharded = io.declare()
        _check_compatible(path, state, trainer, sharded)
        rng = _rng_for_this_rank(path, state)
    except (TrainerCheckpointError, OSError, ValueError, KeyError) as err:
        error = err if isinstance(err, TrainerCheckpointError) else TrainerCheckpointError(
            f"{path}: cannot resume ({type(err).__name__}: {err})")
    if not sharded_state.all_ranks_ok(error is None):
        io.forget(empty)
        raise error or TrainerCheckpointError(f"{path}: cannot resume (see rank 0's error)")
    try:
        loaded = io.load(os.path.join(path, DIST_DIR), sharded)
    except Exception as err:  # noqa: BLE001
        error = TrainerCheckpointError(f"{path}: loading the model and optimizer states failed "
                                       f"({type(err).__name__}: {err})")
    if not sharded_state.all_ranks_ok(error is None):
        io.forget(empty)
        raise error or TrainerCheckpointError(f"{path}: loading failed on another rank")
    # everything is read: now replace the live state
    io.apply(loaded)
    for name, role in trainer._trainable().items():
        role.state.scheduler.load_state_dict(state["schedulers"][name])
    if rng is not None:
        set_rng_state(rng)
    else:
        seed = trainer.cfg.trainer.seed + 7919 * state["step"]
        logger.warning("%s: no saved RNG state for data-parallel rank %d; reseeding from %d",
                       path, trainer.dp_rank, seed)
        trainer._seed_everything(seed)
    trainer.loader.load_state_dict(state["loader"])
    trainer.kl_ctrl.value = state["kl_coef"]
    trainer.step_index = state["step"]
    trainer.metrics.truncate_after(state["metrics_step"])
    trainer.resumed_from = path
    if state["layout"] != _layout():
        logger.info("resumed %s saved at layout %s with layout %s", path, state["layout"],
                    _layout())
    logger.info("resumed from %s at step %d", path, trainer.step_index)
    return path


def finished_run_summary(trainer) -> dict | None:
    """After a resume at or past ``total_steps``: a summary of that run (None otherwise)."""
    path = getattr(trainer, "resumed_from", None)
    if path is None or trainer.step_index < trainer.cfg.trainer.total_steps:
        return None
    summary = {"finished": True, "checkpoint": path, "step": trainer.step_index,
               "total_steps": trainer.cfg.trainer.total_steps}
    metrics_file = os.path.join(trainer.cfg.trainer.output_dir, "metrics.jsonl")
    if os.path.isfile(metrics_file):
        from parallel_models.rl.observe.metrics import read_metrics

        rows = [r for r in read_metrics(metrics_file) if r.get("step", 0) <= trainer.step_index]
        if rows:
            summary["last_metrics"] = {k: v for k, v in rows[-1].items()
                                       if not k.startswith(("timing/", "memory/"))}
    return summary
