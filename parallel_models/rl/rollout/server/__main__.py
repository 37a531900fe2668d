import sys

from parallel_models.rl.rollout.server.cli import main

sys.exit(main())
