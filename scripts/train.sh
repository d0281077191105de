#!/usr/bin/env bash
# Install what memtrain needs (scripts/setup.sh) and train a recipe (default: the embedded default
# recipe, which trains on this CPU in about a minute). Extra arguments go to `memtrain train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
recipe="${1:-recipes/default.yaml}"
shift || true
exec .venv/bin/memtrain train "$recipe" "$@"
