"""The Megatron-LM / Megatron-Bridge folder layouts of ``hf2mcore --format`` and ``save_mcore``
(``checkpoint_utils.megatron_layout``): the files read back as Megatron-LM and Bridge read them
(the tracker, megatron-core's own ``load_common_state_dict`` for the args, ``yaml.safe_load`` for
``run_config.yaml``); megatron-core's ``GPTModel`` loads the iteration folder with
``dist_checkpointing.load`` and matches transformers; our loader, ``save_mcore`` (TP=2) and
``mcore2hf`` read every layout bit-exactly; ``mcore2hf`` with no ``config.json`` rebuilds the HF
config from the run config or the args; broken layouts give errors naming the file."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import yaml

from parallel_models.testing import run_distributed, save_tiny_hf_model
from tests.helpers import checkpoint_checks
from tests.checkpoint.test_checkpoint import assert_bit_exact, convert, to_hf

TOL = 1e-4
# llama3 scaling with the settings megatron-core fixes, so the HF config round-trips exactly
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0}
# name -> (family, tiny-model overrides, --format)
CASES = {"llama-bridge": ("llama", {"rope_scaling": LLAMA3, "max_position_embeddings": 16384},
                          "bridge"),
         "llama-mlm": ("llama", {"rope_scaling": LLAMA3, "max_position_embeddings": 16384},
                       "megatron-lm"),
         "qwen2-bridge": ("qwen2", {}, "bridge"),
         "qwen3yarn-mlm": ("qwen3", {"rope_scaling": YARN, "max_position_embeddings": 64},
                           "megatron-lm")}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    src, out = {}, {}
    for name, (family, overrides, fmt) in CASES.items():
        src[name] = save_tiny_hf_model(str(root / f"{name}.hf"), family, seed=3, **overrides)
        out[name] = str(root / f"{name}.mcore")
        convert(src[name], out[name], format=fmt)
    return {"root": root, "src": src, "out": out}


def iteration_dir(folder: str) -> str:
    """The iteration folder as Megatron-LM finds it: the tracker's number, ``iter_{:07d}``."""
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    return os.path.join(folder, f"iter_{iteration:07d}")


@pytest.mark.parametrize("name", list(CASES))
def test_layout_files_read_as_megatron_reads_them(env, name):
    from megatron.core import dist_checkpointing  # registers megatron-core's safe globals

    family, _, fmt = CASES[name]
    it = iteration_dir(env["out"][name])
    assert it.endswith("iter_0000000")
    # ours (HF config, megatron arguments) beside the tracker; the iteration as Megatron writes it
    assert {"iter_0000000", "latest_checkpointed_iteration.txt", "config.json",
            "mcore_config.json"} <= set(os.listdir(env["out"][name]))
    assert {"metadata.json", ".metadata", "common.pt"} <= set(os.listdir(it))
    assert not {"config.json", "mcore_config.json"} & set(os.listdir(it))
    pm = __import__("parallel_models")
    assert pm.registry.architecture_of(env["out"][name]) == pm.ModelConfig.from_hf(
        env["out"][name]).architecture  # still an HF-style folder for configs and tokenizers
    common = dist_checkpointing.load_common_state_dict(it)  # torch.load, weights_only
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    args = common["args"]
    cfg = __import__("parallel_models").ModelConfig.from_hf(env["src"][name])
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads,
            args.num_query_groups, args.kv_channels) == (
        cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
        cfg.num_key_value_heads, cfg.head_dim)
    assert args.group_query_attention and args.swiglu and args.normalization == "RMSNorm"
    assert args.untie_embeddings_and_output_weights == (not cfg.tie_word_embeddings)
    assert args.add_qkv_bias == cfg.qkv_bias and args.qk_layernorm == cfg.qk_norm
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    assert args.tokenizer_model == env["src"][name] and args.params_dtype == torch.float32
    run_config = os.path.join(it, "run_config.yaml")
    if fmt == "megatron-lm":
        assert not os.path.exists(run_config)
        return
    with open(run_config) as f:
        run = yaml.safe_load(f)
    model = run["model"]
    assert model["_target_"] == "megatron.bridge.models.gpt_provider.GPTModelProvider"
    assert (model["num_layers"], model["num_query_groups"], model["vocab_size"]) == (
        cfg.num_layers, cfg.num_key_value_heads, cfg.vocab_size)
    assert model["share_embeddings_and_output_weights"] == cfg.tie_word_embeddings
    assert model["activation_func"] == {"_target_": "torch.nn.functional.silu", "_call_": False}
    assert model["params_dtype"] == {"_target_": "torch.float32", "_call_": False}
    assert model["tensor_model_parallel_size"] == 1 and model["rope_scaling"] == (family == "llama")
    assert run["tokenizer"]["tokenizer_model"] == env["src"][name]


def test_megatron_core_gpt_model_loads_the_iteration_folder(env):
    cases = [{"name": name, "mcore": iteration_dir(env["out"][name]), "hf": env["src"][name]}
             for name in ("llama-bridge", "qwen3yarn-mlm")]
    errors = run_distributed(checkpoint_checks.megatron_loads, 1, cases, 1, timeout=300)[0]
    assert max(errors.values()) <= TOL, errors


def test_our_loader_and_save_mcore_tp2_and_mcore2hf_read_every_layout(env, tmp_path):
    """from_pretrained(iteration layout) at TP=2 -> save_mcore in each layout -> mcore2hf:
    bit-exact against the source; mcore2hf straight from each hf2mcore layout too."""
    src, out = env["src"]["qwen2-bridge"], env["out"]["qwen2-bridge"]
    jobs = [{"src": out, "head": "causal_lm", "kind": "mcore", "format": fmt,
             "out": str(tmp_path / f"saved-{fmt}")} for fmt in ("bridge", "megatron-lm", "flat")]
    run_distributed(checkpoint_checks.save_roundtrips, 2, jobs, 2, timeout=300)
    assert os.path.isfile(os.path.join(jobs[0]["out"], "iter_0000000", "run_config.yaml"))
    assert not os.path.exists(os.path.join(jobs[1]["out"], "iter_0000000", "run_config.yaml"))
    assert os.path.isfile(os.path.join(jobs[2]["out"], ".metadata"))
    for job in jobs:
        to_hf(job["out"], job["out"] + ".hf")
        assert_bit_exact(src, job["out"] + ".hf")
    for name in CASES:
        to_hf(env["out"][name], str(tmp_path / f"{name}.hf"))
        assert_bit_exact(env["src"][name], str(tmp_path / f"{name}.hf"))


@pytest.mark.parametrize("name", list(CASES))
def test_mcore2hf_rebuilds_the_hf_config_from_run_config_or_args(env, tmp_path, name):
    """A Megatron-LM / Bridge checkpoint has no config.json: mcore2hf rebuilds it from
    run_config.yaml (bridge) or the args (megatron-lm); ModelConfig and config.json fields equal
    the source's, the weights bit-exact."""
    import json

    from parallel_models import ModelConfig

    folder = str(tmp_path / "foreign")
    shutil.copytree(env["out"][name], folder)
    for extra in ("config.json", "mcore_config.json", "generation_config.json"):
        path = os.path.join(folder, extra)
        if os.path.exists(path):
            os.remove(path)
    back = str(tmp_path / "back")
    to_hf(folder, back)
    assert_bit_exact(env["src"][name], back)
    assert ModelConfig.from_hf(back) == ModelConfig.from_hf(env["src"][name])
    with open(os.path.join(env["src"][name], "config.json")) as f:
        want = json.load(f)
    with open(os.path.join(back, "config.json")) as f:
        got = json.load(f)
    for key in ("architectures", "model_type", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "rope_parameters", "rope_scaling", "attention_bias"):
        assert got.get(key) == want.get(key), (key, got.get(key), want.get(key))


def _expect(fn, *needles):
    from parallel_models import CheckpointError, ConfigError

    with pytest.raises((CheckpointError, ConfigError)) as info:
        fn()
    for needle in needles:
        assert needle in str(info.value), str(info.value)


class Crafted:
    """A class a crafted common.pt could ask to build (weights-only loading refuses it)."""


def test_broken_layouts_give_clear_errors(env, tmp_path):
    name = "llama-bridge"
    src = env["src"][name]
    _expect(lambda: convert(src, str(tmp_path / "x"), format="nemo"), "format", "nemo")
    assert not os.path.exists(tmp_path / "x")

    def broken(tag):
        folder = str(tmp_path / tag)
        shutil.copytree(env["out"][name], folder)
        os.remove(os.path.join(folder, "config.json"))
        return folder, os.path.join(folder, "iter_0000000")

    folder, it = broken("tracker")  # the tracker names an iteration that is not there
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    _expect(lambda: to_hf(folder, folder + ".hf"), "iter_0000005")
    folder, it = broken("yaml")  # run_config.yaml without its model section
    with open(os.path.join(it, "run_config.yaml"), "w") as f:
        yaml.safe_dump({"tokenizer": {}}, f)
    _expect(lambda: to_hf(folder, folder + ".hf"), "run_config.yaml", "model")
    folder, it = broken("args")  # Megatron-LM args missing a setting
    os.remove(os.path.join(it, "run_config.yaml"))
    common = torch.load(os.path.join(it, "common.pt"), weights_only=False)
    del common["args"].hidden_size
    torch.save(common, os.path.join(it, "common.pt"))
    _expect(lambda: to_hf(folder, folder + ".hf"), "common.pt", "hidden_size", "--hf-config")
    folder, it = broken("pickle")  # a class that is not allowed in common.pt
    os.remove(os.path.join(it, "run_config.yaml"))
    torch.save({"args": Crafted()}, os.path.join(it, "common.pt"))
    _expect(lambda: to_hf(folder, folder + ".hf"), "common.pt", "refused")
    folder, it = broken("nothing")  # neither run config nor args
    os.remove(os.path.join(it, "run_config.yaml"))
    torch.save({}, os.path.join(it, "common.pt"))
    _expect(lambda: to_hf(folder, folder + ".hf"), "run_config.yaml", "--hf-config")
    for tag in ("tracker", "yaml", "args", "pickle", "nothing"):
        assert not os.path.exists(str(tmp_path / tag) + ".hf")


def test_reading_args_leaves_the_process_safe_globals_as_they_were(env):
    """Our reader allows argparse.Namespace only while it reads; Namespace registered before
    (megatron-core registers it at import, Megatron-LM's loads rely on it) stays registered."""
    import argparse

    from parallel_models.llama.checkpoint_utils.megatron_layout import read_common_state

    it = iteration_dir(env["out"]["llama-mlm"])
    torch.serialization.add_safe_globals([argparse.Namespace])
    assert read_common_state(it)["args"].num_layers > 0
    assert argparse.Namespace in torch.serialization.get_safe_globals()
    torch.serialization._weights_only_unpickler._remove_safe_globals([argparse.Namespace])
    try:
        assert read_common_state(it)["args"].num_layers > 0
        assert argparse.Namespace not in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.add_safe_globals([argparse.Namespace])  # as megatron-core left it
