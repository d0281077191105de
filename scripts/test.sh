#!/usr/bin/env bash
# Install what memtrain needs (scripts/setup.sh), check lint, formatting and types, and run the whole test suite. Extra arguments go to
# pytest (e.g. `-m "not slow"` for a quick pass). Pytest's exit code 5 (no test collected) is a failure.
# The tests run on MEMTRAIN_TEST_WORKERS processes (default 3 on this 2-core machine: many tests wait on the
# processes they start (signals, launches, time-outs): the reliability files alone kept 0.25-0.7 of a core
# busy, CPU seconds over wall; 0: in this process),
# whole test files per worker (pytest-xdist `--dist loadfile`: a module's fixtures are set up once), the
# longest files first (tests/conftest.py, from the seconds tests/slow.txt records).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
# One thread per process: the workers (and the ranks they launch) already fill the two cores, and the
# tiny models gain nothing from a second thread (the default recipe's 300 steps: 73 s on one, 81 s on two).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
# The house first (seconds): lint, formatting and types; then the tests.
.venv/bin/ruff check src tests scripts examples || exit 1
.venv/bin/ruff format --check src tests scripts examples || exit 1
.venv/bin/mypy || exit 1
.venv/bin/python -m pytest -q -n "${MEMTRAIN_TEST_WORKERS:-3}" --dist loadfile "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "[test] pytest collected no test: failing the run" >&2
  exit 1
fi
exit "$status"
