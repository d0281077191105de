"""`python -m memtrain` (and `torchrun -m memtrain`) runs the CLI.

Ctrl-C before training is one line and exit 130. The CLI catches it from its first import of torch on;
this module also covers its own imports (a loaded machine can take a second to reach `main`). It leaves
through `os._exit`: CPython marks a KeyboardInterrupt as unhandled when it passes through code run by
`PyRun_String` (torch's import runs some), even if caught later, and at exit would then kill itself with
SIGINT (-2 to the caller, not 130)."""

import os
import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as memtrain.training.preemption says (not imported: a guarded import)

try:
    from memtrain.cli import main

    code = main()
except KeyboardInterrupt:  # Ctrl-C while this module imported the CLI
    sys.stderr.write("memtrain: interrupted\n")
    code = EXIT_INTERRUPTED
if code == EXIT_INTERRUPTED:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
