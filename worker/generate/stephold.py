"""Fault injection for tests of the generation path: `StepHold` holds a decode step of the
synthetic LM (worker/generate/synthetic_lm.py, param `hold_step = 1`) while a file exists, so a
test can freeze one worker at a known point (mid-step) or make a step that never returns. The
file is `hold_path(key_prefix, model)`, in the temp dir: a test isolates itself by its prefix.
`DeviceBreak` breaks one worker's device the same way (the file `hold_path(...) + ".break"`): from
its next step on, every step and probe of that process raises, as every kernel launch does after
a sticky CUDA error (an illegal memory access) until the process ends.

The hold is taken by one process only: the first step that finds `path` renames it to
`path.held` (rename is atomic, so of several workers one wins) and writes its pid there, then
waits while `path.held` exists. The test releases it by deleting `path.held`, or never does (the
hang guard, worker/health/hang.py, then ends the worker). Test-only; no Redis, no torch.
"""

from __future__ import annotations

import os
import tempfile
import time

POLL_S = 0.05


def hold_path(key_prefix: str, model: str) -> str:
    """The file whose appearance holds the next decode step of `model`'s workers under `key_prefix`."""
    return os.path.join(tempfile.gettempdir(), f"vramguard-stephold-{key_prefix}-{model}")


class StepHold:
    """`path`: the file a test creates to hold the next step (None: never holds)."""

    def __init__(self, path: str | None) -> None:
        self.path = path or None

    def __call__(self) -> None:
        """Hold here while the test wants it (see the module docstring); return at once otherwise."""
        if self.path is None or not os.path.exists(self.path):
            return
        held = self.path + ".held"
        try:
            os.rename(self.path, held)
        except FileNotFoundError:  # another worker took it first
            return
        with open(held, "w") as out:
            out.write(str(os.getpid()))
        while os.path.exists(held):
            time.sleep(POLL_S)


class DeviceBreak:
    """`path`: the file a test creates to break the device of the next worker that steps (None: never).
    Taken by one process as StepHold's file is (renamed to `path.taken`, holding its pid)."""

    ERROR = "CUDA error: an illegal memory access was encountered (injected by a test)"

    def __init__(self, path: str | None) -> None:
        self.path = path or None
        self.broken = False

    def __call__(self) -> None:
        """Raise RuntimeError (CUDA's message) once this process took the break; return otherwise."""
        if not self.broken and self.path is not None and os.path.exists(self.path):
            try:
                os.rename(self.path, self.path + ".taken")
            except FileNotFoundError:  # another worker took it first
                return
            with open(self.path + ".taken", "w") as out:
                out.write(str(os.getpid()))
            self.broken = True
        if self.broken:
            raise RuntimeError(self.ERROR)
