"""Workers and helpers for the rollout-server tests: in-process reference generation, server
subprocess start/stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

EOS = 2  # the builtin tokenizer's </s>, which the server uses as eos by default


def reference_greedy(paths: list[str], prompts: list[list[int]], max_new_tokens: int) -> list:
    """For each model folder: greedy responses (token ids, log-probs) of each prompt generated
    alone, in-process (TP=1)."""
    import parallel_models as pm
    from parallel_models.llama.checkpoint_utils.loader import load_hf_weights
    from parallel_models.rl.generation import SamplingParams, generate

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(paths[0], rmpad=True, dtype=torch.float32)
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, eos_token_id=EOS)
    out = []
    for i, path in enumerate(paths):
        if i:
            load_hf_weights(model, path)
        per = []
        for p in prompts:
            g = generate(model, [p], params)
            n = int(g.response_mask[0].sum())
            per.append((g.responses[0, :n].tolist(), g.log_probs[0, :n].tolist()))
        out.append(per)
    return out


def free_port() -> int:
    from parallel_models.testing import _free_port

    return _free_port()


def start_server(model: str, port: int, *, tp: int = 1, api_key: str | None = None,
                 extra: tuple[str, ...] = (), log_path: str | None = None,
                 timeout: float = 120.0) -> subprocess.Popen:
    """Start ``parallel-models-serve`` (torchrun for tp > 1) and wait for /health."""
    import httpx

    args = ["--model", model, "--port", str(port), "--tp", str(tp), *extra]
    if api_key:
        args += ["--api-key", api_key]
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={tp}", "-m", "parallel_models.rl.server", *args]
    else:
        cmd = [sys.executable, "-m", "parallel_models.rl.server", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = open(log_path).read()[-3000:] if log_path else ""
            raise RuntimeError(f"server exited with {proc.returncode} during start\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    raise TimeoutError("server did not answer /health in time")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM the server (its process group: torchrun and its ranks) and wait."""
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode
