"""``python -m asynccoll``: the same command line as the ``asynccoll`` script."""

import sys

from .cli import main

sys.exit(main())
