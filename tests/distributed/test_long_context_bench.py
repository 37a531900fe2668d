"""The long-context bench (``bench/long_context.py``) in its ``--tiny`` CPU mode as torchrun
runs it: 2 gloo ranks at CP = 2 with full recomputation and the distributed optimizer, the
log-prob path in chunks of 25 of each rank's 128 tokens (``utils/chunked_logprob.py``); one JSON
line per step with the step's tokens/s and each phase's seconds and peak memory, and a finite
update."""

from __future__ import annotations

import json
import math
import os


def test_tiny_cp2_step_prints_one_json_line_per_step():
    """Its 2 ranks forked with torchrun's environment (``start_main_ranks``) instead of a
    ``torchrun`` launch of fresh interpreters."""
    from parallel_models.console_processes import start_main_ranks

    ranks = start_main_ranks("bench.long_context:main", ["--tiny", "--steps", "1", "--warmup",
                                                         "1", "--logits-chunk-mib", "0.05"], 2,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    code = ranks.wait(300)
    assert code == 0, ranks.stdout[-2000:] + ranks.stderr[-3000:]
    lines = [json.loads(x) for x in ranks.stdout.splitlines() if x.startswith("{")]
    assert [x["step"] for x in lines] == [1, 2] and [x["warmup"] for x in lines] == [True, False]
    for x in lines:
        assert x["case"] == "tiny-seq256-cp2-tp1-recompute_full-offload1"
        assert x["tokens"] == 256 and x["world_size"] == 2 and x["update_ok"]
        assert set(x["phases"]) == {"forward_backward", "optimizer"}
        assert x["tokens_per_s"] > 0 and math.isfinite(x["grad_norm"]) and x["grad_norm"] > 0
