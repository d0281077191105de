#!/usr/bin/env bash
# gpu_check.sh: the GPU half of the benchmarks (issue 7) as ONE command, each step time-boxed, about
# 9 minutes in all on one H200 once a CUDA torch is there. Why one script: GPU time is scarce and
# comes in short leases, so everything that needs the GPU must be prepared, bounded and proven on a CPU
# beforehand. On a machine without CUDA the same script runs DRY: every GPU-only step says why it is
# skipped, and each script still runs end to end on a tiny model, so a typo fails here, not on the GPU.
#
#   bash scripts/gpu_check.sh [--out DIR] [--wheels DIR]    # results in DIR (default results/gpu)
#   bash scripts/gpu_check.sh --fetch-wheels DIR [--python-version 3.12]   # on a networked machine
#
# Steps (time box each): setup (seconds with a CUDA torch present; 600 s when it must download one),
# `pytest -m gpu` (120 s: fp8, paged-8bit, activation-offload streams, allocator stats, memory_viz
# snapshot, the allocator model over a profiled run's requests, the planner against the allocator, torch's context-parallel ring on the CUDA attention kernels
# with grouped-query heads, bf16-true's stochastic rounding, each optimizer's and each precision's state
# bytes on CUDA, FSDP2's CPU offload on one CUDA rank),
# scripts/estimator_accuracy.py (85 s),
# scripts/bench_loss.py --device cuda (45 s: standard / chunked / fused loss memory and time),
# scripts/bench_fit_budget.py (200 s), scripts/bench_vs_peers.py --quick (75 s): 525 s plus setup.
# Outputs in DIR: summary.md and summary.json (every step's status, time and reason, the environment,
# each step's own results), one .json and .md per benchmark, pytest_gpu.xml, log.txt.
# Exit status: 0 when no step failed (skipped steps do not fail), 1 otherwise.
#
# What a fresh GPU machine is assumed to have (only the repository is copied there):
# - bash, GNU coreutils (`timeout`), and a python3 >= 3.10 with pip and venv;
# - either a python3 whose torch already sees CUDA (the usual CUDA image: used as it is, nothing is
#   downloaded), or network access to PyPI, where scripts/setup.sh installs MEMTRAIN_TORCH_SPEC (default
#   torch==2.13.0, whose Linux wheel on the default index is a CUDA build; several GB, outside the
#   8 minutes) into .cache/gpu-venv. MEMTRAIN_PYTHON=/path/to/python overrides the choice; an existing
#   .venv is used when its torch sees the GPU;
# - memtrain runs from the checkout (PYTHONPATH=src): nothing of it is installed;
# - small dependencies that python lacks (pydantic, on most CUDA images) are installed with pip --target
#   into .cache/gpu-site, from --wheels DIR (made beforehand with --fetch-wheels on a networked machine)
#   or else from PyPI. Optional ones (deepspeed, bitsandbytes, torchao) are not installed: the tests and
#   estimators that need them skip, saying why.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

OUT="results/gpu"
WHEELS=""
FETCH=""
PYVERSION="3.12"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --fetch-wheels) FETCH="$2"; shift 2 ;;
    --python-version) PYVERSION="$2"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# What memtrain needs beyond torch, by import name and distribution name.
DEPS_IMPORT=(pydantic yaml tqdm numpy matplotlib tokenizers transformers accelerate pytest)
DEPS_DIST=(pydantic pyyaml tqdm numpy matplotlib tokenizers transformers accelerate pytest)
SMALL_WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions pyyaml tqdm)

if [ -n "$FETCH" ]; then
  # Wheels of the small pure dependencies for an offline GPU machine (run where PyPI is reachable).
  mkdir -p "$FETCH"
  { python3 -m pip download --quiet --only-binary=:all: --python-version "$PYVERSION" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$FETCH" "${SMALL_WHEELS[@]}" 2>&1 || echo "gpu_check: pip download failed"; } \
    | grep -v "is ignored: it is neither"  # local mirrors print one such line per package they lack
  [ -n "$(ls -A "$FETCH")" ] || exit 1
  ls -1 "$FETCH"
  exit 0
fi

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
STEPS="$OUT/steps.tsv"
: >"$LOG"
: >"$STEPS"
STARTED=$(date +%s)

say() { echo "[gpu_check] $*" | tee -a "$LOG"; }

# record NAME STATUS SECONDS REASON
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ')" >>"$STEPS"; say "$1: $2 (${3}s) $4"; }

# run NAME LIMIT_SECONDS COMMAND...: run under `timeout`, log to OUT/NAME.log, return its exit status.
run() {
  local name="$1" limit="$2"
  shift 2
  say "$name: $* (time box ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local status=$?
  cat "$OUT/$name.log" >>"$LOG"
  return $status
}

verdict() {  # verdict STATUS -> ok | timed out | failed (exit N)
  case "$1" in
    0) echo ok ;;
    124|137) echo "timed out" ;;
    *) echo "failed (exit $1)" ;;
  esac
}

# ------------------------------------------------------------------------------------------ setup

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
imports_torch() { "$1" -c "import torch" >/dev/null 2>&1; }
sees_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

choose_python() {
  if [ -n "${MEMTRAIN_PYTHON:-}" ]; then echo "$MEMTRAIN_PYTHON"; return; fi
  local gpu=0
  has_gpu && gpu=1
  for py in .venv/bin/python .cache/gpu-venv/bin/python; do
    if [ -x "$py" ] && imports_torch "$py" && { [ $gpu = 0 ] || sees_cuda "$py"; }; then echo "$py"; return; fi
  done
  # The image's own python, as it is (a venv made from it would not see its packages when it is itself a
  # venv); what it lacks goes to .cache/gpu-site, not into it.
  if [ $gpu = 1 ] && command -v python3 >/dev/null && sees_cuda python3; then command -v python3; return; fi
  if [ $gpu = 1 ]; then
    MEMTRAIN_VENV=.cache/gpu-venv MEMTRAIN_TORCH_SPEC="${MEMTRAIN_TORCH_SPEC:-torch==2.13.0}" \
      timeout 600 bash scripts/setup.sh >>"$LOG" 2>&1 && echo .cache/gpu-venv/bin/python && return
  else
    timeout 600 bash scripts/setup.sh >>"$LOG" 2>&1 && echo .venv/bin/python && return
  fi
  echo ""
}

missing_deps() {  # distribution names of DEPS that do not import (one interpreter for all of them)
  "$1" - "${DEPS_IMPORT[@]}" -- "${DEPS_DIST[@]}" 2>/dev/null <<'EOF'
import importlib, sys
args = sys.argv[1:]
names, dists = args[: args.index("--")], args[args.index("--") + 1 :]
for name, dist in zip(names, dists):
    try:
        importlib.import_module(name)
    except Exception:
        print(dist, end=" ")
EOF
}

t0=$(date +%s)
SITE="$REPO/.cache/gpu-site"  # dependencies installed for this check only (pip --target)
export PYTHONPATH="$SITE:$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
PY="$(choose_python)"
SETUP_OK=1
if [ -z "$PY" ] || ! imports_torch "$PY"; then
  record setup failed $(( $(date +%s) - t0 )) "no python with torch: set MEMTRAIN_PYTHON, or give this machine PyPI (see $LOG)"
  SETUP_OK=0
else
  missing="$(missing_deps "$PY")"
  if [ -n "$missing" ]; then
    say "setup: installing missing dependencies: $missing"
    if [ -n "$WHEELS" ]; then
      # shellcheck disable=SC2086
      timeout 120 "$PY" -m pip install --quiet --target "$SITE" --no-index --find-links "$WHEELS" $missing >>"$LOG" 2>&1
    else
      # shellcheck disable=SC2086
      timeout 120 "$PY" -m pip install --quiet --target "$SITE" --retries 0 --timeout 10 $missing >>"$LOG" 2>&1
    fi
    missing="$(missing_deps "$PY")"
  fi
  if [ -n "$missing" ]; then
    record setup failed $(( $(date +%s) - t0 )) "cannot import: $missing(bring wheels with --wheels DIR; see --fetch-wheels)"
    SETUP_OK=0
  fi
fi
if [ $SETUP_OK = 0 ]; then
  for name in pytest_gpu estimator_accuracy loss fit_budget vs_peers; do record "$name" skipped 0 "setup failed"; done
else
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$REPO/.cache/torch_extensions}"
  export PYTHONUNBUFFERED=1
  # The benchmarks' planners probe and time the step here: their step-time multipliers (the CUDA constants'
  # calibration, planner/step_time_calibration.py) land in OUT, and the summary reports them.
  export MEMTRAIN_CACHE_DIR="$OUT/cache"
  "$PY" - >"$OUT/env.json" 2>>"$LOG" <<'EOF'
import json, platform, subprocess, datetime, torch
def git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""
cuda = torch.cuda.is_available()
print(json.dumps({
    "date": datetime.date.today().isoformat(), "python": platform.python_version(), "torch": torch.__version__,
    "cuda_build": torch.version.cuda, "cuda": cuda, "device": torch.cuda.get_device_name() if cuda else "CPU",
    "device_memory_bytes": torch.cuda.mem_get_info()[1] if cuda else None,
    "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
    "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
}, indent=2))
EOF
  # CUDA and torch's version from env.json: each `import torch` costs seconds
  read -r CUDA TORCH_VERSION < <("$PY" -c 'import json, sys; e = json.load(open(sys.argv[1])); print(int(e["cuda"]), e["torch"])' "$OUT/env.json" 2>>"$LOG" || echo "0 unknown")
  record setup ok $(( $(date +%s) - t0 )) "python $PY; CUDA=$CUDA; torch $TORCH_VERSION"

  # ---------------------------------------------------------------------------------------- tests
  t0=$(date +%s)
  # Only the files that mark a test `gpu` are collected: the whole suite's collection took 10 of this step's
  # 16 s on the CPU, for 16 tests in 4 files. tests/conftest.py fails a run in which a `gpu` test sits in
  # a file this pattern misses.
  mapfile -t GPU_TESTS < <(grep -rlE 'mark\.gpu\b' tests --include='test_*.py' | sort)
  run pytest_gpu 120 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml "$OUT/pytest_gpu.xml" "${GPU_TESTS[@]}"
  status=$?
  summary="$(grep -E '(passed|failed|skipped|deselected|error)' "$OUT/pytest_gpu.log" | tail -1)"
  if [ $status = 0 ] && [ "$CUDA" = 0 ]; then
    record pytest_gpu skipped $(( $(date +%s) - t0 )) "needs CUDA: the gpu tests that also run on a CPU passed, the others skipped with their reason ($summary)"
  elif [ $status = 5 ]; then
    record pytest_gpu failed $(( $(date +%s) - t0 )) "no test marked gpu was collected"
  elif [ $status = 0 ]; then
    record pytest_gpu ok $(( $(date +%s) - t0 )) "$summary"
  else
    record pytest_gpu "$(verdict $status)" $(( $(date +%s) - t0 )) "$summary"
  fi

  # ---------------------------------------------------------------------------------------- benchmarks
  # bench NAME LIMIT GPU_ARGS... -- DRY_ARGS...: the script with GPU_ARGS on CUDA; on a CPU with
  # DRY_ARGS (a tiny model), which checks that it runs and reports the step as skipped.
  bench() {
    local name="$1" limit="$2" script="$3"
    shift 3
    local gpu_args=() dry_args=() seen=0 arg
    for arg in "$@"; do
      if [ "$arg" = "--" ]; then seen=1; elif [ $seen = 0 ]; then gpu_args+=("$arg"); else dry_args+=("$arg"); fi
    done
    local t0 status
    t0=$(date +%s)
    if [ "$CUDA" = 1 ]; then
      run "$name" "$limit" "$PY" "scripts/$script" "${gpu_args[@]}" --json "$OUT/$name.json" --markdown "$OUT/$name.md"
      status=$?
      record "$name" "$(verdict $status)" $(( $(date +%s) - t0 )) "scripts/$script ${gpu_args[*]}"
    else  # the tiny model's figures mean nothing: they stay in the log, out of the results
      # The time boxes size the GPU run; a dry run on a busy CPU (the test suite's two workers and their
      # ranks on two cores: load 7-8) ran out of them while working, so a dry run gets DRY_SLACK times.
      run "$name" $(( limit * DRY_SLACK )) "$PY" "scripts/$script" "${dry_args[@]}"
      status=$?
      if [ $status = 0 ]; then
        record "$name" skipped $(( $(date +%s) - t0 )) "needs CUDA; dry run of scripts/$script ${dry_args[*]} passed"
      else
        record "$name" "$(verdict $status)" $(( $(date +%s) - t0 )) "dry run of scripts/$script ${dry_args[*]}"
      fi
    fi
  }
  DRY_SLACK=4
  bench estimator_accuracy 85 estimator_accuracy.py --time-budget 65 -- --model tiny --seq-len 32 --plans 1
  bench loss 45 bench_loss.py --device cuda --vocab 32768 131072 -- --vocab 4096
  bench fit_budget 200 bench_fit_budget.py --time-budget 170 -- --cpu-smoke --model tiny --seq-len 64 --budgets 24 --steps 2
  bench vs_peers 75 bench_vs_peers.py --quick --reps 1 --steps 20 --no-track -- --model tiny --reps 1 --steps 3 --tools hand,memtrain --no-track
fi

# ------------------------------------------------------------------------------------------ summary
ELAPSED=$(( $(date +%s) - STARTED ))
SUMMARY_PY="${PY:-}"
[ -n "$SUMMARY_PY" ] && [ -x "$SUMMARY_PY" ] || SUMMARY_PY=python3
"$SUMMARY_PY" - "$OUT" "$ELAPSED" <<'EOF'
import json, sys
from pathlib import Path
out, elapsed = Path(sys.argv[1]), int(sys.argv[2])
steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, seconds, reason = (line.split("\t") + ["", "", "", ""])[:4]
    steps.append({"step": name, "status": status, "seconds": int(seconds or 0), "reason": reason})
env = json.loads((out / "env.json").read_text()) if (out / "env.json").is_file() else {}
results = {s["step"]: json.loads((out / f"{s['step']}.json").read_text())
           for s in steps if (out / f"{s['step']}.json").is_file()}
failed = [s["step"] for s in steps if s["status"] not in ("ok", "skipped")]
# The step-time multipliers the benchmarks' runs fitted per device, in the order of cost.TERMS
# (compute, recompute, micro_steps, optimizer, communication, offload): the CUDA constants' calibration.
cache = out / "cache" / "step_time.json"
calibration = {}
if cache.is_file():
    try:
        calibration = {key: {"scale": entry.get("scale"), "samples": len(entry.get("samples", []))}
                       for key, entry in json.loads(cache.read_text()).items() if isinstance(entry, dict)}
    except (ValueError, AttributeError) as error:
        calibration = {"unreadable": str(error)}
(out / "summary.json").write_text(json.dumps({"env": env, "seconds": elapsed, "failed": failed, "steps": steps,
                                              "results": results, "step_time_calibration": calibration}, indent=2))
lines = [f"# GPU check: {env.get('date', '')}, {env.get('device', '?')}, torch {env.get('torch', '?')}, "
         f"commit {env.get('commit', '?')}{' (dirty)' if env.get('dirty') else ''}", "",
         "| step | status | seconds | reason |", "|---|---|---|---|"]
lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['reason']} |" for s in steps]
lines += ["", f"Total: {elapsed} s."]
if calibration:
    lines += ["", "## step-time multipliers (compute, recompute, micro_steps, optimizer, communication, offload)", ""]
    lines += [f"- {key}: {value}" for key, value in calibration.items()]
for s in steps:
    md = out / f"{s['step']}.md"
    if md.is_file():
        lines += ["", f"## {s['step']}", "", md.read_text()]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines[:len(steps) + 6]))
sys.exit(1 if failed else 0)
EOF
