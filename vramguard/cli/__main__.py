"""`python -m vramguard.cli ...`: the `vramguard` command without its console script."""

import sys

from vramguard.cli.main import main

sys.exit(main())
