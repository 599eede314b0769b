"""Entry point for `python -m deltasync`."""

import sys

from .cli import main

sys.exit(main())
