"""Adapter-only weight pushes to the rollout server (``rollout.backend=server`` with a LoRA
actor): the trainer's side sends the adapters; the server runs them (``lora/served.py``).

Why the adapters and not the merged targeted weights: with ``all-linear`` the targeted weights
are nearly the whole model (every decoder linear; only the embeddings, norms and head would be
left out), while the adapters are ``rank * (in + out)`` per projection, a few percent of it
(rank 64 on an 8B model: ~170M of 8B parameters). The server keeps its base weights and hangs
the same LoRA layers as the trainer's on its own model (``parallel_models.lora.add_lora``, at
the server's TP), so it computes exactly the trainer's LoRA forward (not a merged approximation
that would also need the unmerged base kept to take the next push). The cost is the rank-r
matmuls per adapted linear in each decode step.

Wire: the ``POST /update_weights_stream`` frames (``inference/server/weight_stream.py``) with the
adapters under PEFT's names at full size and, in the first bucket's header, ``"lora"``: the
PEFT ``adapter_config`` fields (rank, alpha, targets); the server's side is ``lora/served.py``.
"""

from __future__ import annotations

import json
import struct

import torch.distributed as dist

from parallel_models.lora.config import LoraSettings
from parallel_models.lora.peft_io import gather_adapter_tensors


def push_adapter_stream(chunks, client) -> dict:
    """Trainer side (every rank calls): gather the actor's adapters (full size, PEFT's names)
    on rank 0 and stream them to the server. Returns ``{"weight_version", "bytes"}`` on every
    rank (``bytes``: the payload sent); raises ``WeightStreamError`` on every rank if the push
    failed (the server keeps its previous adapters)."""
    from parallel_models.inference.server.weight_stream import (_Sender, bucket_frame,
                                                                 end_frame, shared_outcome)
    from parallel_models.lora.apply import model_chunks

    settings: LoraSettings = model_chunks(chunks)[0].lora_settings
    tensors = gather_adapter_tensors(chunks)
    outcome, sent = None, 0
    if tensors is not None:  # global rank 0
        header, payload = bucket_frame(tensors)
        header = _with_lora(header, settings.peft_config())
        sent = len(payload)
        sender = _Sender(client)
        try:
            sender.put_all([header, payload, end_frame(len(tensors))])
        finally:
            outcome = sender.close()
    version = shared_outcome(outcome, f"adapter push to {client.url}")
    box = [sent]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return {"weight_version": version, "bytes": box[0]}


def _with_lora(header: bytes, lora: dict) -> bytes:
    """A bucket frame's header with the ``"lora"`` settings added."""
    body = json.loads(header[8:])
    body["lora"] = lora
    return struct.pack("<Q", len(json.dumps(body).encode())) + json.dumps(body).encode()
