"""`python -m memtrain` (and `torchrun -m memtrain`) runs the CLI.

Ctrl-C that the CLI caught leaves through `os._exit`: CPython marks a KeyboardInterrupt as unhandled
when it passes through code run by `PyRun_String` (torch's import runs some), even if we catch it
later, and at exit it then kills itself with SIGINT (-2 to the caller, not our 130)."""

import os
import sys

from memtrain.cli import main
from memtrain.training.preemption import EXIT_INTERRUPTED

code = main()
if code == EXIT_INTERRUPTED:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
