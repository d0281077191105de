#!/usr/bin/env bash
# Install the core package (scripts/setup.sh with no extras: the default recipe needs none, and DeepSpeed's
# build alone took minutes) and train a recipe (default: recipes/default.yaml, which trains on this CPU in
# about a minute). Extra arguments go to `memtrain train`. A recipe that needs an optional package is
# refused by name with its install line; `bash scripts/setup.sh` installs every extra (scripts/test.sh
# does). MEMTRAIN_EXTRAS / MEMTRAIN_DEEPSPEED=1 ask for more here.
set -euo pipefail
cd "$(dirname "$0")/.."
MEMTRAIN_EXTRAS="${MEMTRAIN_EXTRAS-}" MEMTRAIN_DEEPSPEED="${MEMTRAIN_DEEPSPEED:-0}" \
  MEMTRAIN_PIP_NO_COMPILE="${MEMTRAIN_PIP_NO_COMPILE:-1}" bash scripts/setup.sh
# One thread unless told otherwise: the default recipe's 0.8M-parameter model gains nothing from a second
# (300 steps: 73 s on one, 81 s on two, scripts/test.sh), and on a busy machine threads that wait on each
# other made its steps ten times slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
recipe="${1:-recipes/default.yaml}"
shift || true
exec .venv/bin/memtrain train "$recipe" "$@"
