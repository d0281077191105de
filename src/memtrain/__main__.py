"""`python -m memtrain` (and `torchrun -m memtrain`) runs the CLI."""

import sys

from memtrain.cli import main

sys.exit(main())
