"""A save killed mid-write, as ``kill -9`` of hf2mcore: ``main([folder])`` opens an
``AtomicOutputDir`` on ``folder``, writes a file into its temporary folder and SIGKILLs its own
process (tests/checkpoint/test_output_dir_stale.py runs it through
``parallel_models.console_processes.start_main``)."""

from __future__ import annotations

import os
import signal


def main(argv: list[str]) -> int:
    from parallel_models.llama.checkpoint_utils.output_dir import AtomicOutputDir

    with AtomicOutputDir(argv[0]) as tmp:
        with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
            f.write(b"x" * 4096)
        os.kill(os.getpid(), signal.SIGKILL)
    return 1  # not reached
