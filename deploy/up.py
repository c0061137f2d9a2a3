"""`python deploy/up.py [options]` is `vramguard up [options]` (vramguard/cli/up.py), kept for the
worker image and docker-compose.yml, which run it from a checkout's copy."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout's vramguard when not installed

from vramguard.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["up", *sys.argv[1:]]))
