import sys

from parallel_models.rl.server.cli import main

sys.exit(main())
