"""The rollout server's side of adapter-only weight pushes (``lora/server_push.py`` sends
them): the server keeps its base weights and hangs the trainer's LoRA layers on its own model
(``add_lora`` at the server's TP), then loads each push's adapters into them.

The stream parser (``inference/server/weight_stream.py``) hands a push whose first header
carries ``"lora"`` to :func:`receive_adapter_push`, which checks the names against the model and
returns an :class:`AdapterPush` job; ``Engine.update_weights`` runs it on every server rank (the
job, with its small tensors, is mirrored to the other ranks). All or nothing: a failure on any
rank restores every rank's previous adapters (on a first push: B = 0, the base model's output).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from parallel_models.errors import ConfigError
from parallel_models.lora.apply import add_lora, lora_linears, lora_modules
from parallel_models.lora.config import LoraSettings
from parallel_models.lora.peft_io import load_adapter_tensors, peft_name


def expected_adapter_names(model, settings: LoraSettings) -> set[str]:
    """PEFT's names of every adapter matrix ``settings`` put on ``model`` (all its layers)."""
    from parallel_models.lora.apply import GATE_UP, QKV
    from parallel_models.lora.experts import PROJECTIONS, peft_module
    from parallel_models.lora.peft_io import PREFIX

    targets = set(settings.target_modules)
    names = set()
    for layer_id, where, _ in lora_linears(model):
        if where == "mlp.experts":  # PEFT's ParamWrappers on the fused expert parameters
            projections = [p for p, t in zip(PROJECTIONS, ("gate_proj", "down_proj"))
                           if t in targets]
            names |= {f"{PREFIX}{layer_id}.{peft_module(projections, p)}.lora_{w}.weight"
                      for p in projections for w in "AB"}
            continue
        last = where.rsplit(".", 1)[1]
        projections = {"qkv_proj": QKV, "gate_up_proj": GATE_UP}.get(last, (last,))
        for proj in projections:
            if proj in targets:
                names |= {peft_name(layer_id, where, proj, w) for w in "AB"}
    return names


def receive_adapter_push(tensors: dict[str, torch.Tensor], lora: dict, model) -> "AdapterPush":
    """Check an adapter push (settings PEFT's, names those the settings give the model; shapes
    are checked on load) -> the job (a ``ValueError`` saying what is wrong otherwise)."""
    try:
        settings = LoraSettings.from_peft_config(lora)
    except ConfigError as err:
        raise ValueError(f"adapter push: {err}") from None
    current = getattr(model, "lora_settings", None)
    if current is not None and (current.rank, current.alpha, current.target_modules) != (
            settings.rank, settings.alpha, settings.target_modules):
        raise ValueError(f"adapter push: r={settings.rank} alpha={settings.alpha} targets="
                                f"{settings.target_modules} differs from the served adapters' "
                                f"(r={current.rank} alpha={current.alpha})")
    want = expected_adapter_names(model, settings)
    problems = [f"{n}: missing" for n in sorted(want - set(tensors))]
    problems += [f"{n}: not an adapter of this model" for n in sorted(set(tensors) - want)]
    if problems:
        raise ValueError("adapter push does not fit the model: " + "; ".join(problems[:5]))
    return AdapterPush(lora, {n: t.clone() for n, t in tensors.items()})


def _adapter_params(model) -> list[torch.Tensor]:
    return [p for _, _, lora in lora_modules(model) for p in lora.parameters()]


@dataclasses.dataclass
class AdapterPush:
    """An adapter push, run by ``Engine.update_weights`` on every server rank."""

    lora: dict
    tensors: dict

    def run_on_every_rank(self, engine) -> dict:
        from parallel_models.inference.engine import WeightUpdateError, all_finite

        rollout = engine.rollout
        model = rollout.model
        t0 = time.perf_counter()
        first = getattr(model, "lora_settings", None) is None
        saved, error = None, None
        try:
            if first:
                add_lora(model, LoraSettings.from_peft_config(self.lora))
            saved = [p.detach().clone() for p in _adapter_params(model)]
            load_adapter_tensors(model, self.tensors)
            if not all(all_finite(p) for p in _adapter_params(model)):
                raise ValueError("non-finite adapter weights")
        except Exception as exc:  # noqa: BLE001 - restored below, reported to the caller
            error = exc
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        group = engine.group if engine.world > 1 else None
        if group is not None:
            dist.all_reduce(failed, group=group)
        if int(failed):
            with torch.no_grad():
                if saved is not None:
                    for p, old in zip(_adapter_params(model), saved):
                        p.copy_(old)
            why = f"{type(error).__name__}: {error}" if error else "it failed on another rank"
            raise WeightUpdateError(f"adapter push: {why} (the previous weights, version "
                                    f"{rollout.version}, were kept)")
        continuous = rollout._continuous
        if continuous is not None:
            continuous.clear_prefixes()  # KV of the old adapters
            if first:  # decode graphs captured without the adapters' layers: capture again
                for step in continuous._steps.values():
                    step.graph = None
        rollout.version += 1
        rollout.weights_path = "<adapter push>"
        return {"weight_version": rollout.version, "path": rollout.weights_path,
                "seconds": round(time.perf_counter() - t0, 3)}
