"""The `vramguard` command and its one launcher: `vramguard up` (also `make up`, deploy/up.py and the
worker image) places the workers (placement.py), writes their supervisor programs (programs.py)
from the shipped supervisord.conf, starts supervisord and waits for readiness (readiness.py);
`down` and `status` act on a stack's run folder (stack.py); `check` reports what `up` would find.
No torch import here: the command answers at once.
"""
