"""The console scripts as a user meets them: the installed scripts (next to this Python) answer
``--help`` / ``--version`` quickly and quietly, bad input is one line with argparse's exit code,
the server says where it listens, the converters refuse to overwrite without ``--overwrite``."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time

import pytest

SCRIPTS = ("parallel-models-ppo", "parallel-models-serve", "hf2mcore", "mcore2hf")
HELP_SECONDS = 5.0  # generous: measured 0.2-0.5 s on a loaded 2-core VM (imports before parsing
# took 8-25 s)
THIRD_PARTY_NOTES = ("Transformer Engine", "Apex", "megatron", "transformers", "Warning")

pytestmark = pytest.mark.timed  # its limits hold with the background stopped: background_lane.py


def _script(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    assert os.path.isfile(path), f"{path}: console script not installed (pip install -e .)"
    return path


def _run(args: list[str], timeout: float = 120.0, **kw) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    return proc, time.perf_counter() - start


def _one_line_error(proc, prog: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_is_fast_and_quiet(name):
    proc, seconds = _run([_script(name), "--help"])
    assert proc.returncode == 0, proc.stderr
    assert seconds < HELP_SECONDS, f"{name} --help took {seconds:.1f} s"
    assert proc.stderr == "", proc.stderr  # no third-party import notes
    assert f"usage: {name}" in proc.stdout and "--version" in proc.stdout


@pytest.mark.parametrize("name", SCRIPTS)
def test_version(name):
    proc, _ = _run([_script(name), "--version"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == [name, importlib.metadata.version("parallel-models")]


def test_ppo_config_error_is_one_line_and_fast():
    proc, seconds = _run([_script("parallel-models-ppo"), "bogus.key=1"])
    assert proc.returncode == 2
    line = _one_line_error(proc, "parallel-models-ppo")
    assert "'bogus'" in line and "actor" in line  # names the key and the valid sections
    assert seconds < HELP_SECONDS, f"a config error took {seconds:.1f} s"
    assert not any(note in proc.stderr for note in THIRD_PARTY_NOTES[:2]), proc.stderr


def test_package_and_config_import_light():
    """``import parallel_models`` / the PPO config do not import torch, megatron-core or
    transformers (what keeps the scripts fast); the public names load on first use."""
    code = ("import sys, parallel_models, parallel_models.rl.config, parallel_models.cli_support\n"
            "print([m for m in ('torch', 'megatron', 'transformers') if m in sys.modules])")
    proc, _ = _run([sys.executable, "-c", code])
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)

    import parallel_models as pm
    from parallel_models.registry import AutoModelForCausalLM

    names = pm.__all__
    assert {"ConfigError", "AutoModelForCausalLM", "LlamaForCausalLMRmPadPP", "init_parallel",
            "save_mcore", "pack_padded_batch"} <= set(names)
    assert set(names) <= set(dir(pm))
    assert all(getattr(pm, n) is not None for n in names)
    assert pm.AutoModelForCausalLM is AutoModelForCausalLM
    assert pm.ConfigError is pm.config.ConfigError and pm.registry.architecture_of
    with pytest.raises(AttributeError, match="no_such_name"):
        pm.no_such_name  # noqa: B018


def test_dtype_argument_spellings():
    from conversion._cli import hf2mcore_parser
    from parallel_models.cli_support import dtype_name, dtype_or_auto

    for given, want in (("float32", "float32"), ("fp32", "float32"), ("bfloat16", "bfloat16"),
                        ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("float16", "float16"),
                        ("fp16", "float16"), ("torch.bfloat16", "bfloat16")):
        assert dtype_name(given) == want
    assert dtype_or_auto("auto") == "auto" and dtype_or_auto("fp16") == "float16"
    with pytest.raises(argparse.ArgumentTypeError, match="float32 | bfloat16 | float16"):
        dtype_name("int8")
    args = hf2mcore_parser().parse_args(["--hf-path", "a", "--output", "b", "--dtype", "bf16"])
    assert args.dtype == "bfloat16"


def test_serve_startup_errors_are_one_line(tmp_path):
    serve = _script("parallel-models-serve")
    missing = str(tmp_path / "no_model")
    proc, seconds = _run([serve, "--model", missing])
    assert proc.returncode == 2 and missing in _one_line_error(proc, "parallel-models-serve")
    assert seconds < HELP_SECONDS
    (tmp_path / "m").mkdir()
    proc, _ = _run([serve, "--model", str(tmp_path / "m")])
    assert proc.returncode == 2 and "config.json" in _one_line_error(proc, "parallel-models-serve")
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with socket.socket() as busy:  # a port in use fails before the model loads
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, seconds = _run([serve, "--model", str(tmp_path / "m"), "--port", str(port)])
    assert proc.returncode == 2 and f"127.0.0.1:{port}" in _one_line_error(proc,
                                                                          "parallel-models-serve")
    assert seconds < HELP_SECONDS
    proc, _ = _run([serve, "--model", str(tmp_path / "m"), "--port", "70000"])
    assert proc.returncode == 2 and "--port" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_options(tmp_path, monkeypatch):
    """``--option name=value``: a bad name or value (or a bad PARALLEL_MODELS_* variable) is one
    line before the model loads; good ones are the process's options when the server starts, with
    the environment's variables over them."""
    from parallel_models import options
    from parallel_models.inference.server import cli

    serve = _script("parallel-models-serve")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    base = [serve, "--model", str(model), "--port", "0"]
    proc, _ = _run(base + ["--option", "cuda_graph=false"])
    assert proc.returncode == 2
    assert "did you mean 'cuda_graphs'" in _one_line_error(proc, "parallel-models-serve")
    proc, _ = _run(base + ["--option", "decode_split=48"])
    assert proc.returncode == 2
    assert "decode_split" in _one_line_error(proc, "parallel-models-serve")
    proc, _ = _run(base, env={**os.environ, "PARALLEL_MODELS_DECODE_ATTENTION": "typo"})
    assert proc.returncode == 2
    assert "PARALLEL_MODELS_DECODE_ATTENTION='typo'" in _one_line_error(proc,
                                                                       "parallel-models-serve")
    seen = {}
    monkeypatch.setattr(cli, "_serve", lambda args, sock: seen.update(
        options.get_options().model_dump()) or 0)
    for var in options.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PARALLEL_MODELS_FUSED_DRAW", "0")
    try:
        assert cli.main(["--model", str(model), "--port", "0", "--option", "cuda_graphs=false",
                         "--option", "decode_split=64", "--option", "fused_draw=true"]) == 0
    finally:
        options.set_options(None)
    assert (seen["cuda_graphs"], seen["decode_split"], seen["fused_draw"]) == (False, 64, False)
    assert seen["decode_attention"] == "triton"  # the others: defaults


def test_serve_help_gives_every_default():
    from parallel_models.inference.server.cli import build_parser

    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest in ("help", "version", "model"):  # --model is required
            continue
        assert "default" in formatter._get_help_string(action), action.dest
    text = " ".join(parser.format_help().split())
    assert "(default: 8000)" in text and "(default: auto)" in text
    assert "bfloat16" in text and "bf16" in text


def test_server_logs_its_url_once_listening(caplog):
    """The server class and socket ``parallel-models-serve`` uses, around a small app: the URL
    (and the OpenAPI docs when the app has them) is logged once it listens, on the port the OS
    chose for ``--port 0``."""
    import threading

    import httpx
    import uvicorn
    from fastapi import FastAPI

    from parallel_models.inference.server import cli

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    sock = cli._bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = cli._server_class()(uvicorn.Config(app, log_level="warning"))
    server.docs_path = app.docs_url
    caplog.set_level("INFO", logger=cli.PROG)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    lines = [r.getMessage() for r in caplog.records if r.name == cli.PROG]
    assert lines == [f"listening on {url} (OpenAPI docs: {url}/docs)"], lines


@pytest.mark.parametrize("name,source_flag", [("hf2mcore", "--hf-path"),
                                              ("mcore2hf", "--mcore-path")])
def test_converters_refuse_existing_output(tmp_path, name, source_flag):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    proc, seconds = _run([_script(name), source_flag, str(tmp_path / "src"), "--output", str(out)])
    assert proc.returncode == 1
    line = _one_line_error(proc, name)
    assert str(out) in line and "--overwrite" in line
    assert (out / "keep.txt").read_text() == "keep" and seconds < HELP_SECONDS


def test_hf2mcore_overwrite_replaces_the_folder(tmp_path, capsys):
    from conversion.scripts import hf2mcore as hf2mcore_main
    from parallel_models.testing import save_tiny_hf_model

    src = save_tiny_hf_model(str(tmp_path / "hf"), "llama", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    assert hf2mcore_main(["--hf-path", src, "--output", str(out), "--quiet", "--overwrite",
                          "--dtype", "fp32", "--format", "flat"]) == 0
    assert not (out / "old.txt").exists() and (out / "mcore_config.json").is_file()
    assert json.loads((out / "mcore_config.json").read_text())
    assert "hf2mcore:" in capsys.readouterr().out
