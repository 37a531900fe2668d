"""Checkpoint conversion refuses bad input with an error that names the problem and leaves no
output behind: missing or truncated files, an unknown architecture, a non-empty output folder, a
dist checkpoint without a tensor, crafted pickles (the models: tests/helpers/checkpoint_setup.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers.checkpoint_setup import convert, expect_error, no_leftovers, to_hf


@pytest.fixture(scope="module")
def env(checkpoint_models):
    return checkpoint_models


# ---- bad input -------------------------------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_hf2mcore_missing_shard_named_in_index(env, tmp_path):
    bad = _copy(env["src"]["llama"], tmp_path / "bad")
    os.remove(os.path.join(bad, "model-00002-of-00004.safetensors"))
    expect_error(lambda: convert(bad, str(tmp_path / "out")), str(tmp_path / "out"),
                 "model-00002-of-00004.safetensors", "missing")


def test_hf2mcore_truncated_safetensors(env, tmp_path):
    bad = _copy(env["src"]["qwen2"], tmp_path / "bad")
    path = os.path.join(bad, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    expect_error(lambda: convert(bad, str(tmp_path / "out")), str(tmp_path / "out"),
                 "model.safetensors", "cannot read")


def test_hf2mcore_unknown_architecture(env, tmp_path, capsys):
    from conversion.hf2mcore import main

    bad = _copy(env["src"]["qwen2"], tmp_path / "bad")
    cfg = json.loads(open(os.path.join(bad, "config.json")).read())
    cfg["architectures"] = ["MistralForCausalLM"]
    open(os.path.join(bad, "config.json"), "w").write(json.dumps(cfg))
    out = str(tmp_path / "out")
    assert main(["--hf-path", bad, "--output", out, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "unsupported architecture 'MistralForCausalLM'" in err and "LlamaForCausalLM" in err
    assert not os.path.exists(out) and no_leftovers(out)


def test_hf2mcore_into_non_empty_folder(env, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    from parallel_models import CheckpointError

    with pytest.raises(CheckpointError, match="not empty"):
        convert(env["src"]["llama"], str(out))
    with pytest.raises(CheckpointError, match="not empty"):
        to_hf(env["mcore"]["llama"], str(out))
    assert sorted(os.listdir(out)) == ["keep.txt"] and no_leftovers(str(out))


def _without_tensor(src: str, dst: str, drop: str) -> str:
    """A real dist checkpoint that lacks one tensor: ``src`` rewritten without ``drop``."""
    from parallel_models.llama.checkpoint_utils import LLAMA, McoreCheckpoint
    from parallel_models.llama.checkpoint_utils.dcp import ChunkItem, write_dist_checkpoint
    from parallel_models.llama.checkpoint_utils.megatron_format import (extra_state_items,
                                                                       write_megatron_files)

    ck = McoreCheckpoint(src, LLAMA)
    items = [ChunkItem(key, tuple(c.offsets), tuple(c.sizes), tuple(md.size), md.properties.dtype,
                       lambda k=key, c=c: ck._chunk(k, c))
             for key, md in ck.tensors.items() if key != drop for c in md.chunks]
    os.makedirs(dst)
    write_dist_checkpoint(dst, items, extra_state_items(ck.config.num_layers))
    write_megatron_files(dst)
    for f in ("config.json", "mcore_config.json"):
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    return dst


def test_mcore2hf_dist_checkpoint_missing_a_tensor(env, tmp_path):
    bad = _without_tensor(env["mcore"]["llama"], str(tmp_path / "bad"),
                          "decoder.layers.mlp.linear_fc2.weight")
    out = str(tmp_path / "out")
    expect_error(lambda: to_hf(bad, out), out, "decoder.layers.mlp.linear_fc2.weight",
                 "model.layers.0.mlp.down_proj.weight")


def test_mcore2hf_missing_or_truncated_chunk_file(env, tmp_path):
    bad = _copy(env["mcore"]["llama"], tmp_path / "bad")
    os.remove(os.path.join(bad, "__0_0.distcp"))
    expect_error(lambda: to_hf(bad, str(tmp_path / "out")), str(tmp_path / "out"),
                 "__0_0.distcp", "missing")
    bad2 = _copy(env["mcore"]["qwen2"], tmp_path / "bad2")
    path = os.path.join(bad2, "__0_0.distcp")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    expect_error(lambda: to_hf(bad2, str(tmp_path / "out2")), str(tmp_path / "out2"),
                 "truncated")


def test_mcore_metadata_is_not_unpickled_blindly(env, tmp_path):
    """A crafted ``.metadata`` cannot run code: only DCP's own classes are allowed."""
    import pickle

    bad = _copy(env["mcore"]["qwen2"], tmp_path / "bad")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    out = str(tmp_path / "out")
    expect_error(lambda: to_hf(bad, out), out, "not allowed")
    assert not marker.exists()
