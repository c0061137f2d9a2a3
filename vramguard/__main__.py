"""`python -m vramguard ...`: the `vramguard` command (pyproject's console script) without its script on PATH."""

import sys

from vramguard.cli.main import main

sys.exit(main())
