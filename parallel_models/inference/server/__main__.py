import sys

from parallel_models.inference.server.cli import main

sys.exit(main())
