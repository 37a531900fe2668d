"""PPO training entrypoint.

    parallel-models-ppo [--config FILE.yaml] [--resume[=auto] | --overwrite] [key=value ...]
    python -m parallel_models.rl.train ...            (same)
    torchrun --nproc-per-node N -m parallel_models.rl.train parallel.tensor_parallel_size=2 ...

With no config at all it runs the built-in default: a tiny Llama and a character tokenizer made
on the spot (it lowercases text and strips accents), built-in prompts and a rule-based reward
that PPO visibly raises in its 20 steps (about half a minute on two CPU cores). Overrides are
dotted keys (``actor.lr=1e-5``, ``trainer.total_steps=50``); every key, its default and meaning: ``parallel_models/rl/configs/default.yaml`` (rendered from the
config models). Problems are reported together, each naming the key, and the exit code is 2;
the prompt files and model paths are checked (``rl/preflight.py``) before anything is written
into ``trainer.output_dir``. Every user error (config, data, model path, checkpoint) is one
``parallel-models-ppo: error: ...`` line and exit code 2; ``--debug`` (or
``PARALLEL_MODELS_DEBUG=1``) shows its traceback instead. Anything else is a bug: a traceback.
The ``kernels`` section (kernel and engine options, :mod:`parallel_models.options`) becomes the
process's options in every rank, with ``PARALLEL_MODELS_<NAME>`` environment variables over it;
the run's ``config.yaml`` records the values that ran.

One run per output folder: a new run into a folder that holds another run stops unless
``--overwrite`` (remove the old run's outputs) or ``--resume`` (continue it, with its own saved
settings; overrides given now apply on top, those that change the model, data, reward or
algorithm only with ``--force-override``); ``--resume=auto`` resumes when there is a checkpoint,
else starts. See ``parallel_models/rl/run_folder.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from parallel_models.cli_support import (add_version_argument, error_exit, log_optional_pieces,
                                         quiet_third_party)

PROG = "parallel-models-ppo"
DEBUG_ENV = "PARALLEL_MODELS_DEBUG"


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` means bad input (config, data, model path, checkpoint), not a bug: a
    one-line message and exit code 2."""
    from parallel_models.errors import ConfigError

    kinds: tuple[type[BaseException], ...] = (ConfigError, FileNotFoundError)
    checkpoint_errors = sys.modules.get("parallel_models.llama.checkpoint_utils.errors")
    if checkpoint_errors is not None:  # not imported: none was raised (and it imports torch)
        kinds += (checkpoint_errors.CheckpointError,)
    return isinstance(err, kinds)


def debug_wanted(args) -> bool:
    return args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    quiet_third_party()
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (default: the built-in default run)")
    parser.add_argument("--resume", action="store_const", const="on", default="off",
                        help="continue the run in trainer.output_dir from its latest checkpoint, "
                             "with the run's saved config.yaml and the overrides given now "
                             "(no checkpoint: exit code 2); --resume=auto: resume if there is a "
                             "checkpoint, else start a new run")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run in trainer.output_dir even if it holds another "
                             "run, removing that run's checkpoints, metrics and exports first")
    parser.add_argument("--force-override", action="store_true",
                        help="with --resume: apply overrides that change what the run is "
                             "(model.*, data.*, reward.*, algorithm.*)")
    parser.add_argument("--resume-fallback", action="store_true",
                        help="with --resume: if the latest checkpoint is damaged, resume the "
                             "newest usable older one (with a warning) instead of stopping")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of user errors too (also: "
                             f"{DEBUG_ENV}=1)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. trainer.total_steps=20")
    add_version_argument(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    auto = "--resume=auto" in argv  # a const flag with one optional value, not a positional
    args = parser.parse_intermixed_args(["--resume" if a == "--resume=auto" else a
                                         for a in argv])  # options anywhere among key=value
    if auto:
        args.resume = "auto"
    # rank 0 logs; the other ranks say only what goes wrong
    rank0 = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")

    from parallel_models.rl.run_folder import clear_previous_run, prepare_run

    checked = False  # the config and inputs: the same on every rank, so rank 0 reports them
    try:
        cfg = prepare_run(args.config, args.overrides, resume=args.resume,
                          overwrite=args.overwrite, force_override=args.force_override,
                          resume_fallback=args.resume_fallback)
        cfg.validate()
        from parallel_models.rl.preflight import check_run_inputs

        check_run_inputs(cfg)  # before anything is written into trainer.output_dir
        checked = True
        clear_previous_run(cfg)
        from parallel_models.options import set_options

        cfg.kernels = set_options(cfg.kernels, "kernels")  # with the environment's overrides
        if rank0:
            log_optional_pieces(logging.getLogger(PROG))
        from parallel_models.rl.trainer import PPOTrainer

        trainer = PPOTrainer(cfg)
        history = trainer.fit()
    except Exception as err:
        if debug_wanted(args) or not is_user_error(err):
            raise
        if rank0 or checked:  # later problems may be one rank's own
            error_exit(PROG, err)
        elif os.environ.get("TORCHELASTIC_RUN_ID"):
            leave_after_rank0()
        return 2
    import torch.distributed as dist

    if history and (not dist.is_initialized() or dist.get_rank() == 0):
        k = max(1, len(history) // 5)
        first = sum(h["reward/mean"] for h in history[:k]) / k
        last = sum(h["reward/mean"] for h in history[-k:]) / k
        print(json.dumps({"steps": trainer.step_index, "reward_first": round(first, 4),
                          "reward_last": round(last, 4), "output_dir": cfg.trainer.output_dir}))
    from parallel_models.distributed import destroy_parallel

    destroy_parallel()
    return 0


def leave_after_rank0(limit_s: float = 60.0) -> None:
    """Under torchrun, a rank other than 0 that found the input problem every rank finds (rank 0
    reports it) waits to be stopped: torchrun stops every rank once one has failed, so leaving
    first could stop rank 0 before its report is printed. Once rank 0 has exited with it,
    torchrun's SIGTERM ends this rank; after ``limit_s`` (rank 0 hung) it leaves anyway."""
    time.sleep(limit_s)


if __name__ == "__main__":
    sys.exit(main())
