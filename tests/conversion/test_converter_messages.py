"""The converters' messages (issue 31 item 6, issue 38 item 6): ``hf2mcore`` given a megatron
checkpoint says to use ``mcore2hf`` (and ``mcore2hf`` given an HF folder says ``hf2mcore``), a
missing input folder is reported at once (before torch / megatron-core / transformers are
imported, and without asking the Hub), and ``hf2mcore --help`` / its docstring list every family
of the registry."""

import os
import subprocess
import sys

import pytest

from parallel_models.llama.families import all_families
from parallel_models.testing import save_tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_script(prog: str, argv: list) -> tuple[int, str, bool]:
    """(exit code, stderr, whether torch got imported) of a console script run in a fresh
    interpreter."""
    code = (f"import sys; from conversion.scripts import {prog}; rc = {prog}({argv!r}); "
            "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH'); sys.exit(rc)")
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120, cwd=ROOT)
    return p.returncode, p.stderr, "NO_TORCH" not in p.stdout


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from conversion.hf2mcore import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("messages")
    hf = save_tiny_hf_model(str(root / "hf"), "llama")
    mcore = str(root / "mcore")
    convert_hf_to_mcore(hf, mcore, progress=False)
    return {"root": root, "hf": hf, "mcore": mcore}


@pytest.mark.parametrize("where", ["run_folder", "iteration"])
def test_hf2mcore_given_a_megatron_checkpoint_names_mcore2hf(folders, where):
    src = folders["mcore"] if where == "run_folder" else os.path.join(folders["mcore"],
                                                                       "iter_0000000")
    rc, err, torch_loaded = _run_script("hf2mcore", ["--hf-path", src, "--output",
                                                     str(folders["root"] / "x")])
    assert rc == 1 and "megatron-core dist checkpoint" in err and "mcore2hf --mcore-path" in err, err
    assert not torch_loaded and not os.path.exists(folders["root"] / "x")


def test_hf2mcore_library_call_names_mcore2hf(folders, tmp_path):
    from conversion.hf2mcore import convert_hf_to_mcore
    from parallel_models.llama.checkpoint_utils.errors import CheckpointError

    with pytest.raises(CheckpointError, match="convert it with mcore2hf"):
        convert_hf_to_mcore(folders["mcore"], str(tmp_path / "y"), progress=False)


@pytest.mark.parametrize("path", ["/no/such/model", "./no_such_model", "../no/such"])
def test_missing_input_folder_is_reported_before_heavy_imports(folders, path):
    rc, err, torch_loaded = _run_script("hf2mcore", ["--hf-path", path, "--output",
                                                     str(folders["root"] / "z")])
    assert rc == 1 and f"{path}: no such folder" in err, err
    assert not torch_loaded
    rc, err, torch_loaded = _run_script("mcore2hf", ["--mcore-path", path, "--output",
                                                     str(folders["root"] / "z")])
    assert rc == 1 and f"{path}: no such folder" in err, err
    assert not torch_loaded


def test_mcore2hf_given_an_hf_folder_names_hf2mcore(folders):
    rc, err, torch_loaded = _run_script("mcore2hf", ["--mcore-path", folders["hf"], "--output",
                                                     str(folders["root"] / "w")])
    assert rc == 1 and "hf2mcore --hf-path" in err, err
    assert not torch_loaded


def test_help_and_docstring_list_every_registered_family():
    import conversion.hf2mcore as hf2mcore
    from conversion._cli import hf2mcore_parser, mcore2hf_parser

    families = all_families()
    assert len(families) >= 6
    texts = {"hf2mcore --help": hf2mcore_parser().format_help().replace("\n", " "),
             "mcore2hf --help": mcore2hf_parser().format_help().replace("\n", " "),
             "hf2mcore docstring": hf2mcore.__doc__}
    for where, text in texts.items():
        for family in families:
            assert f"{family.name} ({family.model_type})" in " ".join(text.split()), (where,
                                                                                     family.name)
