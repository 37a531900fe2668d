"""CUDA IPC handles of a tensor as plain JSON, and the tensor rebuilt from them, without pickle.

For a trainer and a rollout server on one GPU (NCCL cannot join two processes on one device):
the trainer exports its bucket buffer once (``torch.multiprocessing.reductions.reduce_tensor``:
the CUDA IPC memory handle of the allocation, its ref-counter and event handles); the fields go
to the server inside the push's JSON manifest (bytes as base64, classes and dtypes as names),
and the server rebuilds a view of the same memory with ``rebuild_cuda_tensor``, passing the
classes itself. Nothing the peer sends is unpickled or names a class to load.
"""

from __future__ import annotations

import base64

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8)}


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _raw(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text.encode(), validate=True)


def export_handle(tensor: torch.Tensor) -> dict:
    """The fields to rebuild a view of ``tensor`` (a CUDA tensor, kept alive by the caller while
    peers use it) in another process on the same machine: JSON-safe, with the GPU's UUID so the
    peer finds the device whatever its ``CUDA_VISIBLE_DEVICES``."""
    if not tensor.is_cuda:
        raise ValueError("CUDA IPC shares CUDA tensors only")
    _, args = reduce_tensor(tensor.detach())
    (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return {"size": list(size), "stride": list(stride), "offset": int(offset),
            "dtype": str(dtype).removeprefix("torch."),
            "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
            "handle": _b64(handle), "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset), "ref_handle": _b64(ref_handle),
            "ref_offset": int(ref_offset), "event_handle": _b64(event_handle),
            "event_sync": bool(event_sync)}


def local_device_of(uuid: str) -> int:
    """This process's index of the GPU with ``uuid`` (ValueError if it cannot see it)."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ValueError(f"GPU {uuid} is not visible to this process")


def open_handle(fields: dict) -> torch.Tensor:
    """The tensor described by :func:`export_handle`'s ``fields`` (the peer's memory, not a
    copy). ValueError on fields that are not such a description."""
    try:
        dtype = _DTYPES[fields["dtype"]]
        size, stride = torch.Size(int(x) for x in fields["size"]), tuple(
            int(x) for x in fields["stride"])
        device = local_device_of(str(fields["device_uuid"]))
        handle = _raw(fields["handle"])
        args = (int(fields["offset"]), torch.UntypedStorage, dtype, device, handle,
                int(fields["storage_bytes"]), int(fields["storage_offset"]), False,
                _raw(fields["ref_handle"]), int(fields["ref_offset"]),
                _raw(fields.get("event_handle")), bool(fields["event_sync"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a CUDA IPC handle description: {exc}") from None
    return rebuild_cuda_tensor(torch.Tensor, size, stride, *args)


__all__ = ["export_handle", "local_device_of", "open_handle"]
