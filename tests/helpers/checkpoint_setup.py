"""What the checkpoint tests share (tests/test_checkpoint*.py): the tiny models they convert
(Llama: GQA, llama3 rope in the form megatron-core expresses, fp32, source in several safetensors
shards; Qwen2: qkv bias, tied embeddings, bf16; their value versions; a Llama with one KV head),
bit-exact folder comparison, and the converters called in-process."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from parallel_models.testing import save_tiny_hf_model

RUN_TIMEOUT = 240
LOGIT_TOL = 1e-4
MEGATRON_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA = dict(rope_scaling=MEGATRON_ROPE, max_position_embeddings=16384)
MODELS = {  # name: (family, head, dtype, overrides)
    "llama": ("llama", "causal_lm", None, LLAMA),
    "qwen2": ("qwen2", "causal_lm", torch.bfloat16, {}),
    "llama_value": ("llama", "value", None, LLAMA),
    "qwen2_value": ("qwen2", "value", torch.bfloat16, {}),
    "llama_kv1": ("llama", "causal_lm", None, dict(LLAMA, num_key_value_heads=1)),
}
HEAD = {name: spec[1] for name, spec in MODELS.items()}


def load_all(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def assert_bit_exact(src: str, got: str, upcast: bool = False) -> None:
    a, b = load_all(src), load_all(got)
    assert sorted(a) == sorted(b), f"tensor names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        x, y = (a[name].float(), b[name]) if upcast else (a[name], b[name])
        assert x.dtype == y.dtype, f"{name}: dtype {y.dtype}, source {x.dtype}"
        assert torch.equal(x, y), f"{name}: values differ"


def no_leftovers(path: str) -> bool:
    parent, base = os.path.split(os.path.abspath(path))
    return not any(n.startswith(f".{base}.tmp-") for n in os.listdir(parent))


def convert(src, out, **kw):
    from conversion.hf2mcore import convert_hf_to_mcore

    kw.setdefault("format", "flat")  # these tests read the dist checkpoint files in `out` itself
    return convert_hf_to_mcore(src, out, progress=False, **kw)


def to_hf(src, out, **kw):
    from conversion.mcore2hf import convert_mcore_to_hf

    return convert_mcore_to_hf(src, out, progress=False, **kw)


def expect_error(fn, out, *needles):
    """``fn()`` raises a checkpoint / config error naming every needle and leaves no ``out``."""
    import pytest

    from parallel_models import CheckpointError, ConfigError

    with pytest.raises((CheckpointError, ConfigError)) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, msg
    assert not os.path.exists(out) and no_leftovers(out)
    return msg


def build_models(root) -> dict:
    """Every model of ``MODELS`` saved under ``root`` and converted by hf2mcore (also with the
    local layer spec, and Qwen2 in fp32): {"root", "src": name -> HF folder, "mcore": name ->
    mcore folder}."""
    src = {}
    for i, (name, (family, head, dtype, kw)) in enumerate(MODELS.items()):
        shard = "100KB" if name == "llama" else None
        src[name] = save_tiny_hf_model(str(root / name), family, head=head, seed=10 + i,
                                       dtype=dtype, max_shard_size=shard, **kw)
    # tokenizer files travel with the weights
    for f, text in (("tokenizer_config.json", '{"model_max_length": 64}'),
                    ("tokenizer.json", '{"version": "1.0"}')):
        (root / "llama" / f).write_text(text)
    mc = {}
    for name, path in src.items():
        mc[name] = str(root / f"{name}.mcore")
        convert(path, mc[name])
    mc["llama.local"] = str(root / "llama.local.mcore")
    convert(src["llama"], mc["llama.local"], layer_spec="local")
    mc["qwen2.fp32"] = str(root / "qwen2.fp32.mcore")
    convert(src["qwen2"], mc["qwen2.fp32"], dtype="fp32")
    return {"root": root, "src": src, "mcore": mc}
