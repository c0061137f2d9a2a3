"""The memory room sits below the batch's compute: the budget imports nothing of worker/batch/
(the lower module, worker/memory/oom.py, defines what both need)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_the_budget_imports_nothing_of_the_batch_room() -> None:
    """1. A fresh interpreter imports worker/memory/budget.py and the OOM definitions.
    Result: no module of worker/batch/ is loaded, and execute.py's OOM names are the memory room's."""
    code = ("import sys, vramguard.worker.memory.budget, vramguard.worker.memory.oom as oom;"
            "print(sorted(m for m in sys.modules if m.startswith('vramguard.worker.batch')));"
            "import vramguard.worker.batch.execute as ex;"
            "print(ex.CudaContextLost is oom.CudaContextLost and ex.is_oom is oom.is_oom)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout

