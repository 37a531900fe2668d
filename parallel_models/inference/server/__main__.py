"""``python -m parallel_models.inference.server``: the rollout server (under torchrun for
TP > 1), the same as ``parallel-models-serve``."""

import sys

from parallel_models.inference.server.cli import main

sys.exit(main())
