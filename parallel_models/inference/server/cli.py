"""``parallel-models-serve``: start the rollout server.

    parallel-models-serve --model PATH [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                          [--option cuda_graphs=false ...]
    torchrun --nproc_per_node 2 -m parallel_models.inference.server --model PATH --tp 2

Every rank loads its TP shard; rank 0 serves HTTP, the others follow its commands. The API key
may also come from the environment variable ``PARALLEL_MODELS_API_KEY`` (a secret: it is not one
of the kernel options). Access (Host, Origin, admin endpoints, weights peers): ``security.py``.
``--option name=value`` sets the kernel and engine options of :mod:`parallel_models.options`
(``PARALLEL_MODELS_<NAME>`` environment variables still override them, as everywhere).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from parallel_models.cli_support import (DTYPE_HELP, DefaultsHelpFormatter, add_version_argument,
                                         dtype_or_auto, error_exit, log_optional_pieces,
                                         quiet_third_party)
from parallel_models.inference.server.security import LOOPBACK_NAMES

PROG = "parallel-models-serve"
log = logging.getLogger(PROG)


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _positive_or_auto(value: str) -> int | str:
    return "auto" if value == "auto" else _positive(value)


def _port(value: str) -> int:
    n = int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: any free port), got {n}")
    return n


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG,
                                description="Serve a parallel CausalLM for rollouts over HTTP.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder (or megatron-core checkpoint with "
                   "an HF config) of a CausalLM of a registered family (Llama, Qwen2, Qwen3, "
                   "Gemma, Qwen3-MoE, Qwen2-MoE, Mixtral)")
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size (= world size; "
                   "use torchrun for > 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (all endpoints but /health); "
                   "default: $PARALLEL_MODELS_API_KEY when set, else no key")
    p.add_argument("--enable-admin", action="store_true",
                   help="without --api-key: enable the admin endpoints (/shutdown, "
                   "/update_weights*, /weights_group/*); only on a loopback --host")
    p.add_argument("--allowed-hosts", type=_csv, default=(), metavar="HOST,...",
                   help="Host header values accepted besides the bound address (and the "
                   "loopback names on a loopback or wildcard bind); '*': any")
    p.add_argument("--allowed-origins", type=_csv, default=(), metavar="ORIGIN,...",
                   help="browser Origins (scheme://host[:port]) allowed to call the server, "
                   "with CORS answers; others get 403 ('*': any)")
    p.add_argument("--allowed-weight-peers", type=_csv, default=LOOPBACK_NAMES,
                   metavar="HOST[:PORT],...",
                   help="addresses /weights_group/init may join (the trainer's store)")
    p.add_argument("--dtype", type=dtype_or_auto, default="auto", metavar="DTYPE",
                   help=f"auto (bfloat16 on GPU, float32 on CPU) | {DTYPE_HELP}")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="fp8: the decoder linears on e4m3 copies of their weights (inference/fp8), "
                        "re-quantized at every weight load or push")
    p.add_argument("--fp8-scales", choices=("block", "channel"), default="channel",
                   help="--quantization fp8: weight scales per out channel (measured faster) | "
                        "per 128x128 block")
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the continuous batcher's KV pool: bf16 = --dtype (as before) | fp8 = "
                        "e4m3 with a scale per (token, KV head): twice the tokens per budget")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id; one that does "
                   "not load is an error (default: the --model folder, and when none loads "
                   "there only token-id prompts are served)")
    p.add_argument("--max-batch", type=_positive, default=64,
                   help="rows (prompts x n) per batch, and prompts per request")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="--static-batching: how long the batcher waits to fill a batch, in "
                   "milliseconds")
    p.add_argument("--static-batching", action="store_true",
                   help="generate batch by batch (each batch runs until its longest row ends) "
                   "instead of continuous batching")
    p.add_argument("--kv-budget-tokens", type=_positive_or_auto, default=None,
                   help="continuous batching: KV cache positions of all running samples "
                   "together (per layer, this rank's heads); requests wait until theirs fit "
                   "(default: max-batch x (max-prompt-tokens + max-new-tokens); auto: planned "
                   "on CUDA from the device memory left at the engine's memory utilization)")
    p.add_argument("--prefix-cache-tokens", type=int, default=8192,
                   help="continuous batching: prompt tokens whose KV is kept for reuse by "
                   "identical prompts (0: off)")
    p.add_argument("--partial-rollouts", action="store_true",
                   help="continuous batching: a weight update lands between decode steps and "
                   "the requests in flight go on under the new weights (each token's weight "
                   "version in the answer's weight_versions)")
    p.add_argument("--max-prompt-tokens", type=_positive, default=1024,
                   help="longest prompt accepted, in tokens")
    p.add_argument("--max-new-tokens", type=_positive, default=512,
                   help="largest max_new_tokens a request may ask for")
    p.add_argument("--max-n", type=_positive, default=16,
                   help="most samples per prompt (n) a request may ask for")
    p.add_argument("--max-body-bytes", type=_positive, default=4 << 20,
                   help="largest request body, in bytes")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may wait for its results")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a kernel / engine option of parallel_models.options (repeatable), "
                   "e.g. cuda_graphs=false, decode_attention=aten; "
                   "PARALLEL_MODELS_<NAME> environment variables override them")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of the server and uvicorn (the URL and start-up notes are "
                   "always logged)")
    add_version_argument(p)
    return p


def _startup_problem(args) -> str | None:
    """What makes a start impossible, found before the heavy imports (one line), or None."""
    if not os.path.isdir(args.model):
        return f"--model {args.model}: no such folder (give an HF model folder)"
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"--model {args.model}: no config.json in the folder (give an HF model folder)"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        return (f"world size {world} != --tp {args.tp}: start with 'torchrun --nproc_per_node "
                f"{args.tp}' (one TP group per server)")
    return None


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (a busy port fails at once); uvicorn
    starts listening on it once the model is ready (until then a client is refused, not kept
    waiting)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as err:
        raise OSError(f"--host {host}: cannot serve there ({err})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _load_tokenizer(path: str | None, required: bool = False):
    """The tokenizer at ``path``; one that does not load is an error when it was asked for
    (``--tokenizer``), else a warning (token-id prompts still work)."""
    if not path:
        return None
    from parallel_models.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001
        if required:
            raise ValueError(f"--tokenizer {path}: {' '.join(str(exc).split())}") from None
        log.warning("no tokenizer at %s (%s): token-id prompts only", path,
                    " ".join(str(exc).split()))
        return None


def _server_class():
    """uvicorn.Server that turns SIGTERM/SIGINT into a graceful exit without re-raising the
    signal afterwards (uvicorn does, which would skip stopping the other ranks)."""
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        docs_path: str | None = None

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and sockets:
                url = _url(sockets[0])
                docs = f" (OpenAPI docs: {url}{self.docs_path})" if self.docs_path else ""
                log.info("listening on %s%s", url, docs)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in original.items():
                    signal.signal(s, h)

    return Server


def main(argv: list[str] | None = None) -> int:
    quiet_third_party()
    args = build_parser().parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("PARALLEL_MODELS_API_KEY") or None
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(min(logging.INFO, logging.getLevelName(args.log_level.upper())))
    problem = _startup_problem(args)
    if problem:
        return error_exit(PROG, problem)
    from parallel_models.errors import ConfigError
    from parallel_models.options import parse_assignments, set_options

    try:  # every rank: the options of its engine (environment overrides validated here too)
        options = set_options(parse_assignments(args.option, "--option"), "--option")
    except ConfigError as err:
        return error_exit(PROG, err)
    changed = options.model_dump(mode="json", exclude_defaults=True)
    if changed:
        log.info("kernel / engine options: %s", changed)
    from parallel_models.inference.server.security import ServerSecurity

    try:
        args.security = ServerSecurity(
            api_key=args.api_key, bind_host=args.host, enable_admin=args.enable_admin,
            allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
            allowed_weight_peers=args.allowed_weight_peers)
    except ConfigError as err:
        return error_exit(PROG, err)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach it can generate "
                    "(the admin endpoints stay off without a key)", args.host)
    rank = int(os.environ.get("RANK", "0"))
    sock = None
    if rank == 0:
        try:
            sock = _bind(args.host, args.port)
        except OSError as err:
            return error_exit(PROG, err)
        log_optional_pieces(log)
    try:
        return _serve(args, sock)
    except _StartupError as err:
        return error_exit(PROG, err)
    finally:
        if sock is not None:
            sock.close()


class _StartupError(Exception):
    """A problem loading the model or tokenizer: one line, exit code 2."""


def _serve(args, sock) -> int:
    import torch

    import parallel_models as pm
    from parallel_models.errors import ConfigError
    from parallel_models.inference.engine import RolloutEngine
    from parallel_models.inference.server.app import ServerLimits, create_app
    from parallel_models.inference.server.engine import Engine, make_control_group, worker_loop

    pm.init_parallel(tensor_parallel_size=args.tp)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    group = make_control_group()
    dtype = {"auto": torch.bfloat16 if torch.cuda.is_available() else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    try:
        try:
            model = pm.AutoModelForCausalLM.from_pretrained(args.model, rmpad=True, dtype=dtype)
        except (pm.CheckpointError, ConfigError, OSError, ValueError) as err:
            raise _StartupError(f"--model {args.model}: {err}") from None
        model.eval()
        # every rank loads the tokenizer: its EOS / pad ids are part of every generate call
        try:
            tokenizer = _load_tokenizer(args.tokenizer or args.model,
                                        required=args.tokenizer is not None)
        except ValueError as err:
            raise _StartupError(str(err)) from None
    except BaseException:
        pm.destroy_parallel()
        raise
    eos = None if tokenizer is None else tokenizer.eos_token_id
    pad = 0 if tokenizer is None or tokenizer.pad_token_id is None else tokenizer.pad_token_id
    budget = None
    if not args.static_batching:
        budget = args.kv_budget_tokens or args.max_batch * (args.max_prompt_tokens +
                                                            args.max_new_tokens)
    rollout = RolloutEngine(model, eos_token_id=eos, pad_token_id=pad, weights_path=args.model,
                            kv_budget_tokens=budget, max_rows=args.max_batch,
                            prefix_cache_tokens=max(0, args.prefix_cache_tokens), keep_kv=True,
                            weight_dtype="fp8" if args.quantization == "fp8" else "bf16",
                            fp8_scales=args.fp8_scales, kv_cache_dtype=args.kv_cache_dtype)
    engine = Engine(rollout, args.tp, group)
    engine.partial_rollouts = args.partial_rollouts and not args.static_batching
    try:
        if rank != 0:
            worker_loop(engine)
            return 0
        import json

        import uvicorn

        with open(os.path.join(args.model, "config.json")) as f:
            arch = (json.load(f).get("architectures") or [None])[0]
        limits = ServerLimits(max_batch=args.max_batch, batch_window_ms=args.batch_window_ms,
                              max_prompt_tokens=args.max_prompt_tokens,
                              max_new_tokens=args.max_new_tokens, max_n=args.max_n,
                              max_prompts=args.max_batch, max_body_bytes=args.max_body_bytes,
                              request_timeout_s=args.request_timeout)
        batcher_cls = None
        if rollout.continuous:
            from parallel_models.inference.server.continuous_batcher import ContinuousBatcher

            batcher_cls = ContinuousBatcher
        asgi, app, state = create_app(engine, tokenizer, limits, security=args.security,
                                      model_info={"model": args.model, "architecture": arch,
                                                  "dtype": str(dtype).replace("torch.", "")},
                                      batcher_cls=batcher_cls)
        config = uvicorn.Config(asgi, host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=30)
        server = _server_class()(config)
        server.docs_path = getattr(app, "docs_url", None)
        state["server"] = server
        server.run(sockets=[sock])  # SIGTERM / SIGINT / POST /shutdown -> graceful exit
        return 0
    finally:
        if rank == 0:
            engine.stop_workers()
        pm.destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
