"""Checksums beyond the trainer's checkpoints (issue 30 item 7): ``hf2mcore`` and ``mcore2hf``
write ``checksums.json`` into their outputs; ``mcore2hf`` refuses a damaged input and the rollout
server refuses a damaged weight folder, each naming the file; folders without checksums are read
as before."""

import glob
import os
import shutil

import pytest

from parallel_models.testing import save_tiny_hf_model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from conversion.hf2mcore import convert_hf_to_mcore
    from conversion.mcore2hf import convert_mcore_to_hf

    root = tmp_path_factory.mktemp("checksums")
    hf = save_tiny_hf_model(str(root / "hf"), "llama", seed=3)
    mcore = str(root / "mcore")
    convert_hf_to_mcore(hf, mcore, progress=False)
    back = str(root / "back")
    convert_mcore_to_hf(mcore, back, progress=False)
    return {"root": root, "hf": hf, "mcore": mcore, "back": back}


def _flip_a_byte(path: str, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_converter_outputs_carry_verified_checksums(converted):
    from parallel_models.llama.checkpoint_utils.checksums import MANIFEST_FILE, verify_manifest

    for folder in (converted["mcore"], converted["back"]):
        assert os.path.isfile(os.path.join(folder, MANIFEST_FILE))
        assert verify_manifest(folder) is True
    # mcore2hf's output lists its own files (not the copy of hf2mcore's manifest)
    import json

    with open(os.path.join(converted["back"], MANIFEST_FILE)) as f:
        listed = set(json.load(f)["files"])
    assert any(name.endswith(".safetensors") for name in listed)
    assert not any(name.endswith(".distcp") for name in listed)
    # only tensor data is recorded: the small text files beside it stay editable by hand
    with open(os.path.join(converted["mcore"], MANIFEST_FILE)) as f:
        assert all(name.endswith((".distcp", ".safetensors")) for name in json.load(f)["files"])


def test_mcore2hf_refuses_damaged_data_naming_the_file(converted, tmp_path):
    from conversion.mcore2hf import convert_mcore_to_hf
    from parallel_models.llama.checkpoint_utils.errors import CheckpointError

    damaged = str(tmp_path / "mcore")
    shutil.copytree(converted["mcore"], damaged)
    data = sorted(glob.glob(os.path.join(damaged, "**", "*.distcp"), recursive=True))[0]
    _flip_a_byte(data)
    with pytest.raises(CheckpointError, match=rf"{os.path.basename(data)}: corrupted"):
        convert_mcore_to_hf(damaged, str(tmp_path / "out"), progress=False)
    assert not os.path.exists(tmp_path / "out")
    os.remove(os.path.join(damaged, "checksums.json"))  # no manifest: read as before
    convert_mcore_to_hf(damaged, str(tmp_path / "out2"), progress=False)


def _weight_folder_checks(hf: str, intact: str, damaged: str) -> dict:
    """On a gloo rank: the server's weight-folder check on an intact and a damaged folder."""
    import parallel_models as pm
    from parallel_models.inference.server.weight_folder import (WeightFolderError,
                                                                check_weight_folder)

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(hf, rmpad=True)
    check_weight_folder(intact, model)  # accepted
    try:
        check_weight_folder(damaged, model)
    except WeightFolderError as err:
        return {"error": str(err)}
    return {"error": None}


def test_server_weight_folder_check_refuses_damaged_data(converted, tmp_path):
    from parallel_models.testing import run_distributed

    damaged = str(tmp_path / "hf")
    shutil.copytree(converted["back"], damaged)
    shard = sorted(glob.glob(os.path.join(damaged, "*.safetensors")))[0]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 8)
    out = run_distributed(_weight_folder_checks, 1, converted["hf"], converted["back"], damaged)[0]
    assert out["error"] and f"{os.path.basename(shard)}: truncated" in out["error"], out
