"""``moe_layer_freq`` of a Megatron-Bridge run config (or Megatron-LM args) in every form
megatron-core / Megatron-LM accept (issue 38 item 2: Bridge writes ``moe_layer_freq: 1``, which
crashed ``mcore2hf`` without ``--hf-config``): an integer N (every N-th layer from 0, as
megatron-core's ``get_gpt_decoder_block_spec`` reads it), a 0/1 list, Megatron-LM's pattern
string; anything else is one error line naming the setting."""

import os
import shutil

import pytest
import yaml

from tests.helpers.moe_checks import save_moe_model


@pytest.fixture(scope="module")
def bridge_folder(tmp_path_factory):
    """A Qwen3-MoE (3 layers, layer 1 dense) in the bridge layout, without our config.json, so
    the HF config is rebuilt from run_config.yaml."""
    from conversion.hf2mcore import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("freq")
    hf = save_moe_model(str(root / "hf"), "qwen3_moe")
    out = str(root / "mcore")
    convert_hf_to_mcore(hf, out, progress=False)
    os.remove(os.path.join(out, "config.json"))
    return {"root": root, "hf": hf, "mcore": out}


def _with_freq(bridge_folder, name, freq) -> str:
    folder = str(bridge_folder["root"] / name)
    shutil.copytree(bridge_folder["mcore"], folder)
    path = os.path.join(folder, "iter_0000000", "run_config.yaml")
    with open(path) as f:
        run = yaml.safe_load(f)
    run["model"]["moe_layer_freq"] = freq
    with open(path, "w") as f:
        yaml.safe_dump(run, f)
    return folder


@pytest.mark.parametrize("name,freq,dense", [
    ("int1", 1, []), ("int2", 2, [1]), ("list", [1, 0, 1], [1]), ("pattern", "[1]+[0]+[1]", [1]),
    ("pattern_mult", "([1]*1+[0]*1)*1+[1]", [1]), ("int_string", "1", []), ("absent", None, [])])
def test_every_form_of_moe_layer_freq_is_read(bridge_folder, name, freq, dense):
    from parallel_models.llama.checkpoint_utils.mcore_reader import config_of_mcore_dir

    folder = _with_freq(bridge_folder, name, freq)
    config = config_of_mcore_dir(os.path.join(folder, "iter_0000000"))
    assert [i for i in range(config.num_layers) if not config.is_moe_layer(i)] == dense


def test_mcore2hf_without_hf_config_reads_bridges_integer_freq(bridge_folder):
    """The Bridge case of the issue, end to end: moe_layer_freq 2 (layer 1 dense, as the
    checkpoint holds) -> mcore2hf without --hf-config -> the source's tensors."""
    from conversion.mcore2hf import convert_mcore_to_hf
    from tests.helpers.checkpoint_setup import assert_bit_exact

    folder = _with_freq(bridge_folder, "end_to_end", 2)
    out = str(bridge_folder["root"] / "end_to_end_hf")
    convert_mcore_to_hf(folder, out, progress=False)
    assert_bit_exact(bridge_folder["hf"], out)


@pytest.mark.parametrize("name,freq,needle", [
    ("float", 1.5, "expected an integer, a list of 0/1 per layer or a pattern string"),
    ("zero", 0, "an integer must be >= 1"),
    ("short_list", [1, 0], "one 0 or 1 per layer (num_layers=3)"),
    ("bad_entry", [1, 2, 1], "one 0 or 1 per layer"),
    ("code", "__import__('os').getcwd()", "not an integer, a list of 0/1 or a pattern"),
    ("dict", {"a": 1}, "expected an integer")])
def test_bad_moe_layer_freq_is_one_clear_error(bridge_folder, capsys, name, freq, needle):
    from conversion.mcore2hf import main

    folder = _with_freq(bridge_folder, f"bad_{name}", freq)
    rc = main(["--mcore-path", folder, "--output", str(bridge_folder["root"] / f"out_{name}"),
               "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "moe_layer_freq=" in err and needle in err, err
    assert "Traceback" not in err
