"""The dist checkpoint's records (CRC32 in every zip member, streamed through small write buffers
equal to torch.save's), an interrupted conversion leaves nothing, and the hf2mcore / mcore2hf
command lines end to end (the models: tests/helpers/checkpoint_setup.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from tests.helpers.checkpoint_setup import assert_bit_exact, convert, no_leftovers


@pytest.fixture(scope="module")
def env(checkpoint_models):
    return checkpoint_models


# ---- records ---------------------------------------------------------------------------------------
def _records(folder: str):
    """(key, raw bytes) of every chunk record of a dist checkpoint, located by DCP's index."""
    from parallel_models.llama.checkpoint_utils.dcp import read_dcp_metadata

    md = read_dcp_metadata(folder)
    for index, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path,
                                                                         kv[1].offset)):
        with open(os.path.join(folder, info.relative_path), "rb") as f:
            f.seek(info.offset)
            yield index.fqn, f.read(info.length)


def test_hf2mcore_records_carry_crc32(env):
    """Every record hf2mcore writes (range-copied from safetensors or assembled) has a CRC32 in
    each zip member that Python's zipfile verifies, and torch.load reads it."""
    import io
    import zipfile

    n = 0
    for name in ("llama", "qwen2", "qwen2.fp32"):  # verbatim copies, and dtype-converted ones
        for key, raw in _records(env["mcore"][name]):
            zf = zipfile.ZipFile(io.BytesIO(raw))
            assert zf.testzip() is None, f"{name}: {key}: bad CRC32"
            assert all(i.CRC != 0 for i in zf.infolist() if i.file_size), f"{name}: {key}: no CRC32"
            torch.load(io.BytesIO(raw), weights_only=True)
            n += 1
    assert n > 50


def test_records_streamed_through_small_buffers_match_torch_save(tmp_path):
    """A record's data and its CRC32 fields crossing write-buffer boundaries: the file holds the
    records torch.save writes (CRC32 checked by zipfile, values by torch.load), only the
    serialization id differs."""
    import io
    import zipfile

    from parallel_models.llama.checkpoint_utils.dcp import tensor_filler, write_record
    from parallel_models.llama.checkpoint_utils.direct_io import (RangeReader, WriteBehind,
                                                                 segment_filler)
    from parallel_models.llama.checkpoint_utils.torch_record import Placeholder

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 101, generator=gen), torch.randn(5000, generator=gen).bfloat16(),
               torch.zeros(0, 3), torch.arange(3, dtype=torch.int64), torch.randn(3, 1999)]
    src = str(tmp_path / "src.bin")  # the last tensor's bytes, copied verbatim as segments
    with open(src, "wb") as f:
        f.write(b"x" * 123 + tensors[-1].numpy().tobytes())
    wb, reader, path = WriteBehind(size=8192, count=2), RangeReader(), str(tmp_path / "out.bin")
    out, spans = wb.open(path), []
    for i, t in enumerate(tensors):
        start = out.tell()
        if i == len(tensors) - 1:
            write_record(out, Placeholder().tensor(t.shape, t.dtype),
                         segment_filler(reader, [(src, 123, 4000), (src, 4123, t.nbytes - 4000)]))
        else:
            write_record(out, t, tensor_filler(t))
        spans.append((start, out.tell()))
    out.close()
    wb.finish()
    reader.close()
    assert wb.crc_bytes == sum(t.nbytes for t in tensors)
    data = open(path, "rb").read()
    for t, (a, b) in zip(tensors, spans):
        raw = data[a:b]
        assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None
        assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), t)
        ref = io.BytesIO()
        torch.save(t, ref)
        ref = ref.getvalue()
        differ = [k for k in range(len(ref)) if ref[k] != raw[k]]
        sid = zipfile.ZipFile(io.BytesIO(ref)).getinfo("archive/.data/serialization_id")
        assert len(ref) == len(raw) and all(k >= sid.header_offset for k in differ)


def test_interrupted_conversion_leaves_nothing(env, tmp_path, monkeypatch):
    from parallel_models.llama.checkpoint_utils.direct_io import RangeReader

    calls = {"n": 0}
    original = RangeReader.read_into  # what copies the tensors from the safetensors files

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(RangeReader, "read_into", flaky)
    out = str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        convert(env["src"]["llama"], out)
    assert calls["n"] == 7 and not os.path.exists(out) and no_leftovers(out)


# ---- command line ------------------------------------------------------------------------------------------
def _script(name, argv):
    """The console script ``name``'s ``main(argv)`` as a process of its own, forked from the
    preloaded forkserver (the installed scripts themselves: tests/test_cli.py); a
    ``CompletedProcess``."""
    from parallel_models.console_processes import start_main

    run = start_main(f"conversion.scripts:{name}", argv)
    try:
        run.wait(120)
        return subprocess.CompletedProcess(run.args, run.returncode, run.stdout, run.stderr)
    finally:
        run.close()


def test_cli_help():
    from conversion import hf2mcore, mcore2hf

    for mod, flags in ((hf2mcore, ["--hf-path", "--output", "--dtype", "--layer-spec", "--value"]),
                       (mcore2hf, ["--mcore-path", "--output", "--hf-config"])):
        text = mod.build_parser().format_help()
        assert all(f in text for f in flags), text
        with pytest.raises(SystemExit) as info:
            mod.main(["--help"])
        assert info.value.code == 0


def test_cli_end_to_end(env, tmp_path):
    mc, hf = str(tmp_path / "mc"), str(tmp_path / "hf")
    run = _script("hf2mcore", ["--hf-path", env["src"]["qwen2"], "--output", mc, "--dtype", "fp32"])
    assert run.returncode == 0, run.stderr
    assert "hf2mcore: 26 tensors" in run.stdout and "GB/s" in run.stdout, run.stdout
    assert "hf2mcore:" in run.stderr  # the tqdm bar
    run = _script("mcore2hf", ["--mcore-path", mc, "--output", hf])
    assert run.returncode == 0, run.stderr
    assert_bit_exact(env["src"]["qwen2"], hf, upcast=True)
    run = _script("mcore2hf", ["--mcore-path", mc, "--output", hf])
    assert run.returncode == 1 and "error:" in run.stderr and "not empty" in run.stderr
    assert "Traceback" not in run.stderr
