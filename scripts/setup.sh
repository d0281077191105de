#!/usr/bin/env bash
# Creates .venv and installs memtrain with its test tools. Idempotent: a second run installs nothing new.
# MEMTRAIN_EXTRAS (default: the test tools and every optional extra) and MEMTRAIN_DEEPSPEED=0|1 choose
# what goes in beside the core package: scripts/train.sh asks for the core alone (the default recipe needs
# nothing else, and DeepSpeed's build alone took minutes), scripts/test.sh for everything. A later run
# asking for more installs what is missing; one asking for less installs nothing.
#
# torch is installed first and explicitly: an unpinned `torch` from PyPI is a multi-GB CUDA build, while
# the development/CI machines carry a small CPU build of torch 2.13.0 on local disk. Set
# MEMTRAIN_TORCH_SPEC (e.g. "torch==2.6.0" or "torch") to choose another build on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${MEMTRAIN_VENV:-.venv}"
TORCH_SPEC="${MEMTRAIN_TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${MEMTRAIN_EXTRAS-dev,bnb,fp8,galore}"  # set and empty: the core package alone

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
# MEMTRAIN_PIP_NO_COMPILE=1 (scripts/train.sh): no bytecode compiled at install; Python compiles the modules
# a run imports when it imports them. Measured on a fresh venv here (loaded machine): torch 71 s -> 18 s,
# memtrain's core requirements 107 s -> 56 s.
INSTALL=(install)
[ "${MEMTRAIN_PIP_NO_COMPILE:-0}" = "1" ] && INSTALL=(install --no-compile)
if ! "$VENV/bin/python" -W ignore -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC"
  "${PIP[@]}" "${INSTALL[@]}" "$TORCH_SPEC" 2>&1 | grep -v "is ignored: it is neither" || true
  # -W ignore: torch warns that numpy is missing (it comes with memtrain, below)
  "$VENV/bin/python" -W ignore -c "import torch" || { echo "[setup] installing $TORCH_SPEC failed" >&2; exit 1; }
fi
# DeepSpeed is an sdist that imports torch while it builds: install it against the torch above, without
# build isolation (an isolated build would fetch its own multi-GB CUDA torch). Its C++ ops compile on
# first use into TORCH_EXTENSIONS_DIR (scripts/test.sh keeps that in .cache/).
DEEPSPEED="${MEMTRAIN_DEEPSPEED:-1}"
if [ "$DEEPSPEED" = "1" ] && ! "$VENV/bin/python" -c "import deepspeed" 2>/dev/null; then
  echo "[setup] installing deepspeed (no build isolation)"
  "${PIP[@]}" "${INSTALL[@]}" --no-build-isolation "deepspeed>=0.16" 2>&1 | grep -v "is ignored: it is neither" || true
  "$VENV/bin/python" -c "import deepspeed" 2>/dev/null || echo "[setup] deepspeed did not install; its tests will skip" >&2
fi
# DeepSpeed compiles its CPU communication op (deepspeed_shm_comm) the first time a CPU run uses it: about
# two minutes on 2 cores. Build it here, once, into the folder scripts/test.sh points TORCH_EXTENSIONS_DIR
# at, so no test pays for it (a CUDA machine builds what it needs on first use, as DeepSpeed does).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
if [ "$DEEPSPEED" = "1" ] && "$VENV/bin/python" -c "import deepspeed, torch; raise SystemExit(torch.cuda.is_available())" 2>/dev/null \
  && ! ls "$TORCH_EXTENSIONS_DIR"/deepspeed_shm_comm/*.so >/dev/null 2>&1; then
  echo "[setup] building DeepSpeed's CPU communication op into $TORCH_EXTENSIONS_DIR (once)"
  "$VENV/bin/python" -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()" \
    >/dev/null 2>&1 || echo "[setup] DeepSpeed's CPU op did not build; DeepSpeed tests will build it on first use" >&2
fi
# The stamp lists the extras installed with memtrain (one a line); pip runs again when pyproject.toml is
# newer or an extra asked for is not listed.
stamp="$VENV/.memtrain-installed"
missing_extra() {
  local extra
  for extra in ${EXTRAS//,/ }; do
    grep -qx "$extra" "$stamp" || return 0
  done
  return 1
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || missing_extra; then
  target="."
  [ -n "$EXTRAS" ] && target=".[$EXTRAS]"
  echo "[setup] installing memtrain${EXTRAS:+[$EXTRAS]} (editable)"
  # The local wheel mirrors print a warning per package they lack; show pip's output without those.
  log="$(mktemp)"
  if ! "${PIP[@]}" "${INSTALL[@]}" -e "$target" >"$log" 2>&1; then
    grep -v "is ignored: it is neither" "$log" >&2 || true
    echo "[setup] pip install failed; see the messages above" >&2
    rm -f "$log"
    exit 1
  fi
  grep -v "is ignored: it is neither" "$log" || true
  rm -f "$log"
  "$VENV/bin/python" -c "import memtrain, torch; print('[setup] memtrain', memtrain.__version__, 'on torch', torch.__version__)"
  # Extras an earlier run installed stay listed unless pyproject.toml changed since (they may lack a new
  # requirement: the next run asking for them installs them again).
  keep=/dev/null
  [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && keep="$stamp"
  { cat "$keep"; tr ',' '\n' <<<"$EXTRAS"; } | grep -v '^$' | sort -u >"$stamp.new" || true
  mv "$stamp.new" "$stamp"
fi
