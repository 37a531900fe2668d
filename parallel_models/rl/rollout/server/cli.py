"""``parallel-models-serve``: start the rollout server.

    parallel-models-serve --model PATH [--host 127.0.0.1] [--port 8000] [--api-key KEY]
    torchrun --nproc_per_node 2 -m parallel_models.rl.rollout.server --model PATH --tp 2

Every rank loads its TP shard; rank 0 serves HTTP, the others follow its commands. The API key
may also come from the environment variable ``PARALLEL_MODELS_API_KEY``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parallel-models-serve",
                                description="Serve a parallel CausalLM for rollouts over HTTP.")
    p.add_argument("--model", required=True, help="HF folder (or megatron-core checkpoint with "
                   "an HF config) of a Llama/Qwen2 CausalLM")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= world size; use "
                   "torchrun for > 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PARALLEL_MODELS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (all endpoints but /health)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model; "
                   "text prompts are refused when none loads)")
    p.add_argument("--max-batch", type=int, default=64, help="rows (prompts x n) per batch")
    p.add_argument("--batch-window-ms", type=float, default=5.0)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-n", type=int, default=16)
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    p.add_argument("--log-level", default="warning")
    return p


def _load_tokenizer(path: str | None):
    if not path:
        return None
    try:
        from parallel_models.rl.tokenizer import load_tokenizer

        return load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - token-id prompts still work
        logging.getLogger(__name__).warning("no tokenizer at %s (%s): token-id prompts only",
                                            path, exc)
        return None


def _server_class():
    """uvicorn.Server that turns SIGTERM/SIGINT into a graceful exit without re-raising the
    signal afterwards (uvicorn does, which would skip stopping the other ranks)."""
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
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
    args = build_parser().parse_args(argv)
    for name, v in (("--tp", args.tp), ("--max-batch", args.max_batch), ("--max-n", args.max_n),
                    ("--max-new-tokens", args.max_new_tokens),
                    ("--max-prompt-tokens", args.max_prompt_tokens)):
        if v < 1:
            raise SystemExit(f"{name} must be >= 1, got {v}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    import parallel_models as pm
    from parallel_models.rl.rollout.engine import RolloutEngine
    from parallel_models.rl.rollout.server.app import ServerLimits, create_app
    from parallel_models.rl.rollout.server.engine import Engine, make_control_group, worker_loop

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        raise SystemExit(f"world size {world} != --tp {args.tp}: start with "
                         f"'torchrun --nproc_per_node {args.tp}' (one TP group per server)")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logging.getLogger(__name__).warning(
            "serving on %s without --api-key: anyone who can reach it can generate, load "
            "weights from server paths and shut it down", args.host)
    pm.init_parallel(tensor_parallel_size=args.tp)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    group = make_control_group()
    dtype = {"auto": torch.bfloat16 if torch.cuda.is_available() else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    model = pm.AutoModelForCausalLM.from_pretrained(args.model, rmpad=True, dtype=dtype)
    model.eval()
    # every rank loads the tokenizer: its EOS / pad ids are part of every generate call
    tokenizer = _load_tokenizer(args.tokenizer or args.model)
    eos = None if tokenizer is None else tokenizer.eos_token_id
    pad = 0 if tokenizer is None or tokenizer.pad_token_id is None else tokenizer.pad_token_id
    rollout = RolloutEngine(model, eos_token_id=eos, pad_token_id=pad, weights_path=args.model)
    engine = Engine(rollout, args.tp, group)
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
        asgi, _, state = create_app(engine, tokenizer, limits, api_key=args.api_key,
                                    model_info={"model": args.model, "architecture": arch,
                                                "dtype": str(dtype).replace("torch.", "")})
        config = uvicorn.Config(asgi, host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=30)
        server = _server_class()(config)
        state["server"] = server
        server.run()  # SIGTERM / SIGINT / POST /shutdown -> graceful exit
        return 0
    finally:
        if rank == 0:
            engine.stop_workers()
        pm.destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
