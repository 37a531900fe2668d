"""FP8 routed experts as two grouped GEMMs (the FP8 side of ``llama/layers/grouped_experts.py``).

The experts of a ``GroupedGemmExperts`` layer get per-output-channel scales (the layout
``torch._scaled_grouped_mm`` takes on Hopper: ``scale_b`` ``[experts, out]``, per-token
``scale_a``; it has no 128 x 128 block mode), their FP8 copies packed into one ``[experts, out,
in]`` e4m3 tensor and one ``[experts, out]`` scale tensor that each expert linear's
``fp8_weight`` / ``fp8_scale`` buffers are views of (:func:`pack_experts`), so a decode step
reads them in place. :func:`fp8_experts_forward` is then the bf16 path's computation with FP8
operands:

    fc1 = scaled_grouped_mm(e4m3(x), [W1_e^T]) -> silu(gate) * up, scaled by the routing
    probability (fp32) -> out = scaled_grouped_mm(e4m3(act), [W2_e^T])

on CUDA (SM 9.x, checked once per device against the emulation: a warning and the emulation if
it fails), and elsewhere the emulation (activations quantized and dequantized per token, weights
dequantized, ``torch._grouped_mm`` in the activation dtype), which computes what the per-expert
FP8 linears compute one expert at a time. The counts stay on the device: CUDA graphs capture it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from parallel_models.inference.fp8.quantize import (E4M3, dequantize_activation,
                                                    quantize_activation)

log = logging.getLogger(__name__)
EXPERT_GRANULARITY = "channel"
_probed: dict = {}  # device -> whether _scaled_grouped_mm ran and agreed with the emulation


def expert_linears(experts) -> dict[str, list[torch.nn.Module]]:
    """``{"linear_fc1": [...], "linear_fc2": [...]}``: the local experts' linears."""
    return {attr: [getattr(e, attr) for e in experts.local_experts]
            for attr in ("linear_fc1", "linear_fc2")}


def _is_packed(modules, packed: torch.Tensor | None) -> bool:
    return packed is not None and packed.device == modules[0].weight.device and all(
        m.fp8_weight.data_ptr() == packed[i].data_ptr() for i, m in enumerate(modules))


def pack_experts(experts) -> None:
    """(Re)make each projection's packed FP8 buffers and point the expert linears' buffers at
    their slices (again after the buffers were moved, e.g. offloaded and back)."""
    for attr, modules in expert_linears(experts).items():
        data = getattr(experts, f"fp8_{attr}_weight", None)
        if _is_packed(modules, data):
            continue
        out, inp = modules[0].weight.shape
        device = modules[0].weight.device
        data = torch.zeros(len(modules), out, inp, dtype=E4M3, device=device)
        scale = torch.ones(len(modules), out, dtype=torch.float32, device=device)
        setattr(experts, f"fp8_{attr}_weight", data)
        setattr(experts, f"fp8_{attr}_scale", scale)
        for i, m in enumerate(modules):
            m.register_buffer("fp8_weight", data[i], persistent=False)
            m.register_buffer("fp8_scale", scale[i], persistent=False)
            m.fp8_backend = None


def _emulated(x, wq, ws, offs):
    xq, xs = quantize_activation(x, EXPERT_GRANULARITY)
    x_deq = dequantize_activation(xq, xs, EXPERT_GRANULARITY, x.dtype)
    w_deq = (wq.float() * ws[:, :, None]).to(x.dtype)
    return torch._grouped_mm(x_deq, w_deq.transpose(1, 2), offs=offs)


def _scaled(x, wq, ws, offs):
    xq, xs = quantize_activation(x, EXPERT_GRANULARITY)
    return torch._scaled_grouped_mm(xq, wq.transpose(1, 2), xs, ws, offs=offs,
                                    out_dtype=torch.bfloat16).to(x.dtype)


def _scaled_ok(device: torch.device) -> bool:
    """Once per device (outside a graph capture): ``_scaled_grouped_mm`` runs here and agrees
    with the emulation."""
    key = str(device)
    if key not in _probed:
        if not hasattr(torch, "_scaled_grouped_mm") or \
                torch.cuda.get_device_capability(device)[0] != 9:
            _probed[key] = False
            return False
        if torch.cuda.is_current_stream_capturing():
            return False
        from parallel_models.inference.fp8.quantize import quantize_weight

        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(64, 256, device=device, generator=g, dtype=torch.bfloat16)
        ws = [quantize_weight(torch.randn(128, 256, device=device, generator=g),
                              EXPERT_GRANULARITY) for _ in range(4)]
        wq, sc = torch.stack([w.data for w in ws]), torch.stack([w.scale for w in ws])
        offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32, device=device)
        try:
            got, want = _scaled(x, wq, sc, offs).float(), _emulated(x.float(), wq, sc, offs)
            err = float(((got - want).abs() / (want.abs() + 1.0)).max())
            _probed[key], problem = err < 0.05, f"differs from the emulation by {err:.3g}"
        except RuntimeError as exc:
            _probed[key], problem = False, f"{type(exc).__name__}: {exc}"
        if not _probed[key]:
            log.warning("fp8: torch._scaled_grouped_mm on %s %s; the FP8 experts run emulated "
                        "(dequantized) instead", torch.cuda.get_device_name(device), problem)
    return _probed[key]


def _grouped(x, experts, attr, offs):
    wq, ws = getattr(experts, f"fp8_{attr}_weight"), getattr(experts, f"fp8_{attr}_scale")
    if x.is_cuda and _scaled_ok(x.device):
        return _scaled(x, wq, ws, offs)
    return _emulated(x, wq, ws, offs)


def fp8_experts_forward(experts, x, tokens_per_expert, permuted_probs):
    """``GroupedGemmExperts.forward`` on the packed FP8 copies (see the module docstring)."""
    counts = torch.as_tensor(tokens_per_expert).to(device=x.device)
    offs = torch.cumsum(counts, dim=0).to(torch.int32)
    fc1 = _grouped(x, experts, "linear_fc1", offs)
    gate, up = torch.chunk(fc1, 2, dim=-1)
    act = F.silu(gate) * up
    act = (act * permuted_probs.unsqueeze(-1)).to(x.dtype)
    return _grouped(act, experts, "linear_fc2", offs), None


__all__ = ["EXPERT_GRANULARITY", "expert_linears", "fp8_experts_forward", "pack_experts"]
