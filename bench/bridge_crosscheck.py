"""Cross-check of our conversions against Megatron-Bridge's, on the CPU (tiny models, gloo, one
process). Runs where ``megatron.bridge`` imports (Python 3.12; bench/bridge_crosscheck.sh installs
the wheels and runs it on the GPU host). Independent oracle: Bridge's own conversion code.

For each tiny model (Llama GQA + llama3 RoPE, Qwen2 with tied embeddings and qkv bias), fp32 and
bf16:
1. HF -> mcore: our ``hf2mcore`` (default layout) vs Bridge's ``to_megatron_model`` +
   ``save_megatron_model``; every tensor of the two dist checkpoints read with torch DCP
   (``dcp_to_torch_save``, not our reader) and compared bit by bit.
2. Bridge opens ours: ``AutoBridge.load_megatron_model(our folder)`` (it reads our
   ``run_config.yaml``); its weights equal those of Bridge's own import, tensor by tensor.
3. mcore -> HF: our ``mcore2hf`` on Bridge's checkpoint, and Bridge's ``export_hf_weights`` of
   the model it loaded from ours, both bit-exact against the source safetensors.

    PYTHONPATH=. python bench/bridge_crosscheck.py [--out DIR]

Prints one line per check and a JSON summary (also ``DIR/bridge_crosscheck.json``); exit code 1
if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

import torch

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
MODELS = {"llama": {"rope_scaling": LLAMA3, "max_position_embeddings": 16384},
          "qwen2": {}}


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
    convert_hf_to_mcore(src, ours, progress=False)

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

    bridge = AutoBridge.from_hf_pretrained(src)  # in the checkpoint's dtype
    theirs = os.path.join(root, f"{name}.bridge")
    state: dict = {}

    def bridge_import():
        model = bridge.to_megatron_model(wrap_with_ddp=False, use_cpu_initialization=True)
        state["imported"] = model_weights(model)
        bridge.save_megatron_model(model, theirs, hf_tokenizer_path=src)
        return compare(dcp_tensors(iteration_dir(ours)), dcp_tensors(iteration_dir(theirs)))

    check("hf2mcore_vs_bridge_import", bridge_import)

    def bridge_opens_ours():
        model = bridge.load_megatron_model(ours, wrap_with_ddp=False)
        state["from_ours"] = model
        return compare(model_weights(model), state["imported"])

    check("bridge_load_megatron_model_of_ours", bridge_opens_ours)

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
    import megatron.bridge
    import megatron.core
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "megatron_core": megatron.core.__version__,
            "megatron_bridge": getattr(megatron.bridge, "__version__", "?")}
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
               "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bridge_crosscheck.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"bridge_crosscheck: {summary['passed']} passed, {len(failed)} failed"
          + (f": {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
