"""Cross-check of our conversions against Megatron-Bridge's, on the CPU (tiny models, gloo, one
process). Runs where ``megatron.bridge`` imports (Python 3.12; bench/bridge_crosscheck.sh installs
the wheels and runs it on the GPU host). Independent oracle: Bridge's own conversion code.

For each tiny model (Llama GQA + llama3 RoPE, Qwen2 with tied embeddings and qkv bias, and the MoE
families: Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral, every layer MoE), fp32 and
bf16:
1. HF -> mcore: our ``hf2mcore`` (default layout) vs Bridge's ``to_megatron_model`` +
   ``save_megatron_model``; every tensor of the two dist checkpoints read with torch DCP
   (``dcp_to_torch_save``, not our reader) and compared bit by bit. MoE: Bridge saves the layers
   stacked under one key (its integer ``moe_layer_freq``), we write one key per layer (a list):
   ours are stacked along a new leading axis (``stack_layers``) before the comparison; we write
   the norm names of the layer spec Bridge's model uses (``te``, or ``mcore-local`` without
   transformer-engine).
2. Bridge opens ours: ``AutoBridge.load_megatron_model``'s steps on our folder (its latest
   ``iter_*``; ``load_model_config`` reads our ``run_config.yaml``, ``build_and_load_model`` loads
   the weights); its weights equal those of Bridge's own import, tensor by tensor, and the
   architecture settings it reads equal those of its own provider for the HF model.
Without transformer-engine (the GPU host has none) Bridge's providers are switched to Bridge's own
local layer spec and unfused kernels (``without_te``); the weights' layout is the same.
3. mcore -> HF: our ``mcore2hf`` on Bridge's checkpoint (for MoE: its stacked layout), with
   ``--hf-config`` and from Bridge's ``run_config.yaml`` alone, and Bridge's
   ``export_hf_weights`` of the model it loaded from ours, all bit-exact against the source
   safetensors.

    PYTHONPATH=. python bench/bridge_crosscheck.py [--out DIR]

Prints one line per check and a JSON summary (also ``DIR/bridge_crosscheck.json``); exit code 1
if any check fails.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import traceback
import types

import torch

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
MODELS = {"llama": {"rope_scaling": LLAMA3, "max_position_embeddings": 16384},
          "qwen2": {},
          # every layer MoE: Bridge's integer moe_layer_freq (its stacked layout)
          "qwen3_moe": {"mlp_only_layers": []}, "qwen2_moe": {"mlp_only_layers": []},
          "mixtral": {}}
MOE = ("qwen3_moe", "qwen2_moe", "mixtral")
SKIPPED: dict[str, str] = {}  # case -> why Bridge could not take it (no bridge for the family)


# Bridge modules that import transformer-engine at the top only for their TE-fused variants (the
# LoRA layers, which model_bridge imports): without transformer-engine they are loaded with ``te``
# bound to a stand-in whose classes nothing is an instance of, so their TE paths are never taken.
_TE_AT_IMPORT = {"megatron.bridge.peft.lora_layers": "import transformer_engine.pytorch as te\n"}


# Packages Bridge imports at the top of modules on the way to its checkpoint code but uses only
# for other features: megatron-energon (multimodal data loading; its training config names the
# energon dataset config). Without them they are absent modules whose names are empty classes.
_ABSENT_PACKAGES = ("megatron.energon",)


class _AbsentTE(type):
    """``te.X.Y``: a fresh empty class (isinstance checks against it are False); used as a
    decorator it returns what it decorates; subscripted (``Generic[T]``) itself."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentTE(name, (), {})

    def __getitem__(cls, item):
        return cls

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return type.__call__(cls)


class _AbsentModule(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentTE(name, (), {})


class _WithoutTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == p or name.startswith(p + ".") for p in _ABSENT_PACKAGES):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name not in _TE_AT_IMPORT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        self.origin = spec.origin
        return importlib.util.spec_from_file_location(name, spec.origin, loader=self)

    def create_module(self, spec):
        if spec.name not in _TE_AT_IMPORT:
            module = _AbsentModule(spec.name)
            module.__path__ = []
            return module
        return None

    def exec_module(self, module):
        if isinstance(module, _AbsentModule):
            return
        with open(module.__spec__.origin) as f:
            source = f.read()
        line = _TE_AT_IMPORT[module.__name__]
        if line not in source:
            raise ImportError(f"{module.__spec__.origin}: expected {line.strip()!r} (another "
                              "Bridge version?)")
        module.__dict__["_AbsentTE"] = _AbsentTE
        source = source.replace(line, "te = _AbsentTE('transformer_engine.pytorch', (), {})\n")
        exec(compile(source, module.__spec__.origin, "exec"), module.__dict__)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def import_bridge():
    """``megatron.bridge`` (its ``__init__`` imports every model bridge), with the TE-only
    imports and the packages above made absent when they are not installed (reported)."""
    global _ABSENT_PACKAGES
    _ABSENT_PACKAGES = tuple(p for p in _ABSENT_PACKAGES if not _installed(p))
    if importlib.util.find_spec("transformer_engine") is not None:
        _TE_AT_IMPORT.clear()
    if _ABSENT_PACKAGES or _TE_AT_IMPORT:
        sys.meta_path.insert(0, _WithoutTE())
    import megatron.bridge

    return megatron.bridge


# architecture settings of Bridge's provider that must agree (TransformerConfig / GPTModelProvider)
SETTINGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "kv_channels", "layernorm_epsilon", "normalization",
            "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias",
            "qk_layernorm", "vocab_size", "seq_length", "share_embeddings_and_output_weights",
            "position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling",
            "rope_scaling_factor", "seq_len_interpolation_factor", "params_dtype", "bf16", "fp16")
MOE_SETTINGS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                "moe_router_pre_softmax", "moe_router_score_function",
                "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_grouped_gemm",
                "moe_permute_fusion", "moe_token_dispatcher_type")
# where we differ from Bridge on purpose (reported, not failed): the router in fp32 as
# transformers and our MoE layer compute it (Bridge: the params dtype)
MOE_REPORTED = ("moe_router_dtype",)
FUSIONS = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion",
           "masked_softmax_fusion", "persist_layer_norm", "gradient_accumulation_fusion",
           "cross_entropy_loss_fusion")


def without_te(provider):
    """A Bridge provider set up for a host without transformer-engine: Bridge's own local layer
    spec (its default asks for TE's) and the fused kernels off. Weights and their layout are
    not touched by either setting."""
    if importlib.util.find_spec("transformer_engine") is None:
        from megatron.bridge.models.gpt_provider import local_layer_spec

        provider.transformer_layer_spec = local_layer_spec
        for name in FUSIONS + ("moe_permute_fusion", "moe_grouped_gemm"):  # TE kernels; the
            if hasattr(provider, name):                                  # keys are the same
                setattr(provider, name, False)
    return provider


def layer_spec_of_bridge() -> str:
    """The norm names of the spec Bridge's providers build here (``hf2mcore --layer-spec``)."""
    return "te" if importlib.util.find_spec("transformer_engine") is not None else "mcore-local"


def stack_layers(tensors: dict, num_layers: int) -> dict:
    """Per-layer keys (``decoder.layers.{i}.X``) stacked along a new leading axis under
    ``decoder.layers.X``, megatron-core's layout for homogeneous layers (an every-layer MoE model
    with an integer ``moe_layer_freq``); other keys as they are."""
    import re

    out, per = {}, {}
    for key, t in tensors.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", key)
        if m:
            per.setdefault(m.group(2), {})[int(m.group(1))] = t
        else:
            out[key] = t
    for rest, by_layer in per.items():
        if sorted(by_layer) != list(range(num_layers)):
            raise ValueError(f"decoder.layers.*.{rest}: layers {sorted(by_layer)} of {num_layers}")
        out[f"decoder.layers.{rest}"] = torch.stack([by_layer[i] for i in range(num_layers)])
    return out


def moe_flags(freq, num_layers: int) -> list[int]:
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    return list(freq)


def init_dist() -> None:
    """One gloo process with megatron-core's model-parallel groups (TP=PP=1): Bridge then skips
    its own temporary (NCCL) context."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from parallel_models import cpu_shim

    cpu_shim.apply()  # megatron-core on the CPU (active only without CUDA)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        model_parallel_cuda_manual_seed(0)
    except Exception:  # noqa: BLE001 - no CUDA RNG on the CPU; Bridge copes the same way
        pass


def dcp_tensors(folder: str) -> dict:
    """Every tensor of a dist checkpoint folder, read with torch DCP's own reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "all.pt")
        dcp_to_torch_save(folder, path)
        state = torch.load(path, weights_only=False)  # written just now from the folder above
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def iteration_dir(folder: str) -> str:
    subs = sorted(d for d in os.listdir(folder) if d.startswith("iter_"))
    return os.path.join(folder, subs[-1]) if subs else folder


def compare(a: dict, b: dict) -> dict:
    """Keys only on one side, and keys whose tensors differ (shape, dtype or any bit)."""
    diff = [k for k in sorted(a.keys() & b.keys())
            if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    return {"only_ours": sorted(a.keys() - b.keys()), "only_bridge": sorted(b.keys() - a.keys()),
            "differ": diff, "compared": len(a.keys() & b.keys())}


def hf_tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def model_weights(models) -> dict:
    out = {}
    for k, v in models[0].state_dict().items():
        if isinstance(v, torch.Tensor) and "_extra_state" not in k:
            out[k] = v.detach().cpu()
    return out


def run_case(name: str, family: str, dtype, root: str, results: dict) -> None:
    from megatron.bridge import AutoBridge

    from conversion.hf2mcore import convert_hf_to_mcore
    from conversion.mcore2hf import convert_mcore_to_hf
    from parallel_models.testing import save_tiny_hf_model

    src = save_tiny_hf_model(os.path.join(root, f"{name}.hf"), family, seed=5, dtype=dtype,
                             **MODELS[family])
    ours = os.path.join(root, f"{name}.ours")
    moe = family in MOE
    convert_hf_to_mcore(src, ours, progress=False,
                        layer_spec=layer_spec_of_bridge() if moe else "te")

    def check(label, fn):
        try:
            value = fn()
            ok = not (value.get("only_ours") or value.get("only_bridge") or value.get("differ")) \
                if isinstance(value, dict) else bool(value)
        except Exception as err:  # noqa: BLE001 - record and go on with the other checks
            value, ok = {"error": f"{type(err).__name__}: {err}",
                         "traceback": traceback.format_exc(limit=-6)}, False
        results[f"{name}/{label}"] = {"ok": ok, **(value if isinstance(value, dict) else {})}
        print(f"{'PASS' if ok else 'FAIL'} {name}/{label}: "
              + json.dumps({k: v for k, v in (value if isinstance(value, dict) else {}).items()
                            if k != "traceback"})[:400], flush=True)

    try:
        bridge = AutoBridge.from_hf_pretrained(src)  # in the checkpoint's dtype
    except Exception as err:  # noqa: BLE001 - Bridge has no bridge for this architecture
        if "add support" not in str(err) and "not supported" not in str(err).lower():
            raise
        SKIPPED[name] = str(err).strip().splitlines()[0][:300]
        print(f"SKIP {name}: this Megatron-Bridge has no bridge for it: {SKIPPED[name]}",
              flush=True)
        return
    theirs = os.path.join(root, f"{name}.bridge")
    state: dict = {}

    def bridge_import():  # what AutoBridge.to_megatron_model does, TE settings aside
        provider = bridge.to_megatron_provider(load_weights=True)
        state["moe_settings"] = {f: getattr(provider, f, None)
                                 for f in MOE_SETTINGS + MOE_REPORTED + ("moe_layer_freq",)}
        provider = without_te(provider)
        state["provider"] = provider
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False,
                                                   use_cpu_initialization=True)
        state["imported"] = model_weights(model)
        bridge.save_megatron_model(model, theirs)  # (the tiny models have no tokenizer)
        mine = dcp_tensors(iteration_dir(ours))
        if moe:  # Bridge's MoE layers are stacked (its integer moe_layer_freq), ours per layer
            mine = stack_layers(mine, provider.num_layers)
        return compare(mine, dcp_tensors(iteration_dir(theirs)))

    check("hf2mcore_vs_bridge_import", bridge_import)

    def bridge_opens_ours():
        # AutoBridge.load_megatron_model(ours): the latest iter_* folder, then
        # model_load_save.load_megatron_model = load_model_config (our run_config.yaml ->
        # Bridge's provider) + build_and_load_model; called in those two steps so the
        # provider can be set up for a host without transformer-engine in between
        from megatron.bridge.training.model_load_save import (build_and_load_model,
                                                              load_model_config)

        folder = iteration_dir(ours)
        config, mlm_args = load_model_config(folder)
        assert mlm_args is None, "Bridge took our folder for a Megatron-LM one"
        model = build_and_load_model(folder, without_te(config), use_cpu_init=True,
                                     skip_temp_dist_context=True)
        model = model if isinstance(model, list) else [model]
        state["from_ours"] = model
        return compare(model_weights(model), state["imported"])

    check("bridge_load_megatron_model_of_ours", bridge_opens_ours)

    def bridge_reads_our_settings():
        # the model settings Bridge reads from our run_config.yaml equal those of its own
        # provider for the HF model (weights alone would not show, e.g., a RoPE setting)
        from megatron.bridge.training.model_load_save import load_model_config

        ours_cfg, _ = load_model_config(iteration_dir(ours))
        theirs_cfg = state["provider"]
        diff = {f: (getattr(ours_cfg, f, None), getattr(theirs_cfg, f, None)) for f in SETTINGS
                if getattr(ours_cfg, f, None) != getattr(theirs_cfg, f, None)}
        reported = {}
        if moe:  # Bridge's provider before the host's TE settings; moe_layer_freq as flags
            theirs_moe = state["moe_settings"]
            diff.update({f: (getattr(ours_cfg, f, None), theirs_moe[f]) for f in MOE_SETTINGS
                         if getattr(ours_cfg, f, None) != theirs_moe[f]})
            layers = theirs_cfg.num_layers
            if moe_flags(ours_cfg.moe_layer_freq, layers) != moe_flags(
                    theirs_moe["moe_layer_freq"], layers):
                diff["moe_layer_freq"] = (ours_cfg.moe_layer_freq, theirs_moe["moe_layer_freq"])
            reported = {f: {"ours": getattr(ours_cfg, f, None), "bridge": theirs_moe[f]}
                        for f in MOE_REPORTED}
        return {"differ": [f"{k}: ours {a!r}, Bridge's {b!r}" for k, (a, b) in diff.items()],
                "compared": len(SETTINGS) + (len(MOE_SETTINGS) + 1 if moe else 0),
                "reported": reported}

    check("bridge_run_config_settings_of_ours", bridge_reads_our_settings)

    def ours_reads_bridge():
        back = os.path.join(root, f"{name}.bridge.hf")
        convert_mcore_to_hf(theirs, back, progress=False, hf_config=src)
        return compare(hf_tensors(back), hf_tensors(src))

    check("mcore2hf_of_bridge_checkpoint", ours_reads_bridge)

    def ours_reads_bridge_without_hf_config():
        back = os.path.join(root, f"{name}.bridge.noconfig.hf")
        convert_mcore_to_hf(theirs, back, progress=False)  # from Bridge's run_config.yaml
        from parallel_models import ModelConfig

        same = ModelConfig.from_hf(back) == ModelConfig.from_hf(src)
        return {**compare(hf_tensors(back), hf_tensors(src)),
                **({} if same else {"differ": ["ModelConfig"]})}

    check("mcore2hf_of_bridge_checkpoint_run_config_only", ours_reads_bridge_without_hf_config)

    def bridge_exports_ours():
        model = state["from_ours"]
        got = {n: t.detach().cpu() for n, t in bridge.export_hf_weights(model, cpu=True,
                                                                          show_progress=False)}
        return compare(got, hf_tensors(src))

    check("bridge_export_of_ours_vs_source", bridge_exports_ours)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp())
    args = p.parse_args(argv)
    bridge = import_bridge()
    import megatron.core
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "megatron_core": megatron.core.__version__,
            "megatron_bridge": getattr(bridge, "__version__", "?"),
            "absent": list(_ABSENT_PACKAGES) + (["transformer_engine"] if _TE_AT_IMPORT else [])}
    print("versions:", json.dumps(info), flush=True)
    init_dist()
    from parallel_models import cpu_shim

    results: dict = {}
    with tempfile.TemporaryDirectory() as root, cpu_shim.cuda_to_cpu():
        for family in MODELS:
            for dtype in (torch.float32, torch.bfloat16):
                run_case(f"{family}-{str(dtype).replace('torch.', '')}", family, dtype, root,
                         results)
    failed = [k for k, v in results.items() if not v["ok"]]
    summary = {"versions": info, "passed": len(results) - len(failed), "failed": failed,
               "skipped": SKIPPED, "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bridge_crosscheck.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"bridge_crosscheck: {summary['passed']} passed, {len(failed)} failed"
          + (f": {failed}" if failed else "")
          + (f"; skipped (no bridge in this Bridge version): {sorted(SKIPPED)}" if SKIPPED else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
