"""Entry point for `python -m deltasync`."""

import sys

from deltasync.tools.cli import main

sys.exit(main())
