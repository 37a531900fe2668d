"""Process groups: torch.distributed start-up and megatron-core ``parallel_state``.

``init_parallel`` is the one call a program makes before building models. It starts
torch.distributed from the torchrun environment (or as a single process when there is none), nccl
with CUDA and gloo without, then builds megatron-core's tensor/pipeline/data-parallel groups and
records them as the *training layout* (:func:`training_layout`, a
:class:`~parallel_models.parallel_layout.ParallelLayout`): the layout models are built in unless
they are given another one.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from parallel_models import cpu_shim
from parallel_models.parallel_layout import ParallelLayout


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    virtual_pipeline_parallel_size: int | None
    data_parallel_size: int
    sequence_parallel: bool
    expert_parallel_size: int = 1
    context_parallel_size: int = 1


_SETTINGS: ParallelSettings | None = None
_TRAINING_LAYOUT: ParallelLayout | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (rendezvous, test servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_process_group(timeout_minutes: float) -> None:
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:
        # a plain `python script.py`: one rank on a private port. Nothing is written to
        # os.environ, so child processes (servers, torchrun jobs) do not inherit this rendezvous.
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, timeout=timeout)
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timeout)


def init_parallel(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    virtual_pipeline_parallel_size: int | None = None,
    sequence_parallel: bool = False,
    timeout_minutes: float = 30.0,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> ParallelSettings:
    """Start torch.distributed (if needed) and megatron-core's model-parallel groups.

    The data-parallel size is what is left: world_size / (TP * CP * PP). Context parallel (CP)
    splits every packed sequence over ``context_parallel_size`` ranks (megatron's CP groups,
    ranks next to the TP ones; ``parallel_models/context_parallel.py``). Expert parallel (EP) splits
    the experts of MoE layers over ``expert_model_parallel_size`` ranks; megatron-core lays the
    expert groups over the same ranks as the dense layers' data-parallel (x TP) ranks, so the
    world must be a multiple of TP * PP and of EP * PP (experts' TP equals the dense TP).
    """
    global _SETTINGS, _TRAINING_LAYOUT
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size),
                        ("expert_model_parallel_size", expert_model_parallel_size),
                        ("context_parallel_size", context_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if virtual_pipeline_parallel_size is not None:
        if virtual_pipeline_parallel_size < 1:
            raise ValueError("virtual_pipeline_parallel_size must be >= 1 or None, "
                             f"got {virtual_pipeline_parallel_size}")
        if virtual_pipeline_parallel_size > 1 and pipeline_parallel_size < 2:
            raise ValueError("virtual_pipeline_parallel_size > 1 needs pipeline_parallel_size > 1")
    if sequence_parallel and tensor_parallel_size == 1:
        sequence_parallel = False  # nothing to split; megatron would only warn

    _start_process_group(timeout_minutes)
    cpu_shim.apply()  # no-op with CUDA
    world = dist.get_world_size()
    cp = context_parallel_size
    if world % (tensor_parallel_size * pipeline_parallel_size * cp):
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel_size ({tensor_parallel_size})"
            f" x pipeline_parallel_size ({pipeline_parallel_size})"
            + (f" x context_parallel_size ({cp})" if cp > 1 else ""))
    ep = expert_model_parallel_size
    if (world // pipeline_parallel_size) % (tensor_parallel_size * ep):
        raise ValueError(
            f"world size {world} / pipeline_parallel_size ({pipeline_parallel_size}) is not "
            f"divisible by tensor_parallel_size ({tensor_parallel_size}) x "
            f"expert_model_parallel_size ({ep}) (the experts' TP x EP x expert-DP grid)")

    vpp = virtual_pipeline_parallel_size if (virtual_pipeline_parallel_size or 1) > 1 else None
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
    )
    _SETTINGS = ParallelSettings(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        virtual_pipeline_parallel_size=vpp,
        data_parallel_size=world // (tensor_parallel_size * pipeline_parallel_size * cp),
        sequence_parallel=sequence_parallel,
        expert_parallel_size=ep,
        context_parallel_size=cp,
    )
    _TRAINING_LAYOUT = ParallelLayout.from_parallel_state(
        sequence_parallel=sequence_parallel, virtual_pipeline_parallel_size=vpp)
    return _SETTINGS


def get_parallel_settings() -> ParallelSettings:
    if _SETTINGS is None or not mpu.model_parallel_is_initialized():
        raise RuntimeError("parallel groups are not initialized: call "
                           "parallel_models.init_parallel(...) first")
    return _SETTINGS


def training_layout() -> ParallelLayout:
    """The training layout ``init_parallel`` built (megatron-core's groups, as a value): what
    models are built in when they are not given a layout."""
    if _TRAINING_LAYOUT is None or not mpu.model_parallel_is_initialized():
        raise RuntimeError("parallel groups are not initialized: call "
                           "parallel_models.init_parallel(...) first")
    return _TRAINING_LAYOUT


def layout_or_training(layout: ParallelLayout | None) -> ParallelLayout:
    """``layout``, or the training layout when it is None (the default of every builder)."""
    return training_layout() if layout is None else layout


def is_initialized() -> bool:
    return _SETTINGS is not None and mpu.model_parallel_is_initialized()


def destroy_parallel() -> None:
    """Tear down megatron-core groups and the default process group."""
    global _SETTINGS, _TRAINING_LAYOUT
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _SETTINGS = None
    _TRAINING_LAYOUT = None


def compute_device() -> torch.device:
    """The device this rank computes on: its CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
