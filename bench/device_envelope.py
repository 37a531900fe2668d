"""Run a GPU bench inside a smaller card's memory: an H100 80 GB envelope on a larger card (the
device lease may serve an H200 where an H100 was asked for).

Two things make a process see ``device_mib`` MiB instead of the card's memory:

- ``torch.cuda.mem_get_info`` reports ``total = device_mib`` and ``free = device_mib - used``
  (``used``: what the card has in use, all processes), so the rollout's memory planner
  (``inference/memory_plan.py``, vLLM's ``gpu_memory_utilization``) plans as it would on the
  smaller card;
- PyTorch's caching allocator is capped (``torch.cuda.set_per_process_memory_fraction``) at
  ``device_mib`` less what the process holds outside the allocator when the cap is set (the CUDA
  context) and ``RESERVE_MIB`` for what comes later outside it (NCCL's buffers, cuBLAS/Triton
  modules): an allocation the smaller card could not serve raises CUDA out of memory here too.

Use as a launcher (``torchrun ... bench/device_envelope.py --device-mib 81559 -m
parallel_models.rl.train key=value ...``) or call :func:`apply` at the top of a bench.
81,559 MiB is what an H100 80GB HBM3 reports (``nvidia-smi``, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import os
import runpy
import sys

RESERVE_MIB = 1024


def apply(device_mib: int) -> dict:
    """Cap this process's view of its CUDA device (``LOCAL_RANK``'s, else the current one) at
    ``device_mib``; returns what was set (empty where there is no CUDA or the card is smaller)."""
    import torch

    if not device_mib or not torch.cuda.is_available():
        return {}
    device = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    torch.cuda.set_device(device)
    real_mem_get_info = torch.cuda.mem_get_info
    free, total = real_mem_get_info(device)
    cap = device_mib << 20
    if total <= cap:
        return {}
    outside = total - free - torch.cuda.memory_reserved(device)  # context (+ other processes)
    allocator = cap - outside - (RESERVE_MIB << 20)
    torch.cuda.set_per_process_memory_fraction(allocator / total, device)

    def mem_get_info(dev=None):
        free_now, total_now = real_mem_get_info(dev)
        return max(cap - (total_now - free_now), 0), cap

    torch.cuda.mem_get_info = mem_get_info
    return {"device_mib": device_mib, "card_mib": total >> 20,
            "allocator_cap_mib": allocator >> 20, "outside_allocator_mib": outside >> 20}


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) < 3 or argv[0] != "--device-mib" or argv[2] != "-m":
        sys.exit("usage: device_envelope.py --device-mib MIB -m MODULE [ARGS...]")
    info = apply(int(argv[1]))
    if info and os.environ.get("RANK", "0") == "0":
        print(f"device_envelope: {info}", flush=True)
    sys.argv = [argv[3], *argv[4:]]
    runpy.run_module(argv[3], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
