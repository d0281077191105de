"""Planning time (issue 44): CPU seconds of `memtrain plan` for every recipes/*.yaml on the what-if its comments
name, the 70B what-if (llama-70b-64gpu on 64 H100s) and the 405B mesh search on 1,024 GPUs (llama-405b,
128 nodes of 8), with each plan's predicted peak, so a faster planner is seen to predict the same.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_plan_time.py --out /tmp/after.json
    PYTHONPATH=/work/main/src ... scripts/bench_plan_time.py --src /work/main/src --out /tmp/before.json
    .venv/bin/python scripts/bench_plan_time.py --compare /tmp/before.json /tmp/after.json

Each plan runs as `python -m memtrain plan ... --json` in a process of its own, with `--src` on its PYTHONPATH
(default: this checkout's src) and `MEMTRAIN_CACHE_DIR` pointed at an empty directory (a cold cache: no trace
or link file of an earlier run is read); CPU seconds are the child's user + system time (`getrusage`), not
wall time, which a shared machine stretches. The recipes that name a hub model plan from a throw-away Hugging
Face cache holding its config.json alone (as tests/pretrained/test_real_scale_recipe.py stages it:
tests/hf_cache.py's config, offline). `--warm` plans each case a second time against the cache the first
run left (what a user's next what-if of the same model costs). `--only TEXT` keeps the cases whose name
contains TEXT. `--json-dir DIR` keeps each cold plan's `--json` there (one file a case), so two trees' plans
can be diffed (`--compare` does when both results name their directory: the same text but for the mesh
search's own `search_seconds`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HUB_ID = "meta-llama/Llama-3.1-8B-Instruct"
TARGETS = {  # the what-if each recipe's comments plan it for (default: one H100)
    "gpt2-124m-24gb.yaml": ["--gpu", "rtx4090-24gb"],
    "llama-70b-64gpu.yaml": ["--gpu", "h100-80gb", "--world-size", "64"],
    "llama-405b.yaml": ["--gpu", "h100-80gb", "--nodes", "128"],
    "llama3-8b-8xh100.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama3-8b-chat-sft.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama3-8b-lora-8gpu.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama3-8b-dpo-8xh100.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama2-70b-lora-8xh100.yaml": ["--gpu", "h100-80gb", "--world-size", "8"],
    "llama2-70b-qlora-fsdp-2gpu.yaml": ["--gpu", "h100-80gb", "--world-size", "2"],
    "llama3-8b-qlora-24gb.yaml": ["--gpu", "rtx4090-24gb"],
}
NAMED = {  # what the issue names besides the recipes, as the recipe and target that plan it
    "70B what-if (llama-70b-64gpu, 64 x H100)": "llama-70b-64gpu.yaml",
    "405B mesh search, 1,024 x H100 (llama-405b --nodes 128)": "llama-405b.yaml",
}


def cases() -> dict[str, list[str]]:
    """Case name -> `memtrain plan` arguments."""
    out = {}
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        out[path.name] = [str(path), *TARGETS.get(path.name, ["--gpu", "h100-80gb"])]
    for name, recipe in NAMED.items():
        out[name] = [str(REPO / "recipes" / recipe), *TARGETS[recipe]]
    return out


def stage_hub_cache(home: Path) -> None:
    """A Hugging Face cache under `home` holding HUB_ID's config.json alone (tests/hf_cache.py's)."""
    sys.path.insert(0, str(REPO / "tests"))
    from hf_cache import CONFIG  # the real config.json of HUB_ID

    snapshot = home / "hub" / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs/main").write_text("0123456789abcdef")
    (snapshot / "config.json").write_text(json.dumps(CONFIG))


def plan_once(argv: list[str], env: dict[str, str], keep: Path | None = None) -> dict[str, Any]:
    """CPU and wall seconds of one `memtrain plan --json`, its exit code and predicted peak (`keep`: its
    --json written there)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "memtrain", "plan", *argv, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if keep is not None:
        keep.write_text(done.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    peak: int | None = None
    chosen = ""
    if done.returncode == 0:
        doc = json.loads(done.stdout)
        found = doc["chosen"] if "meshes" in doc else doc
        peak = found["predicted"]["peak"]
        chosen = json.dumps(found.get("summary") or found.get("mesh"), sort_keys=True)
    elif "Traceback" in done.stderr:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return {"rc": done.returncode, "cpu_s": cpu, "wall_s": wall, "peak": peak, "chosen": chosen}


def run(src: Path, only: str, warm: bool, json_dir: Path | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "hf"
        stage_hub_cache(home)
        for name, argv in cases().items():
            if only not in name:
                continue
            cache = Path(tmp) / f"cache-{len(results)}"
            env = {
                **os.environ,
                "PYTHONPATH": str(src),
                "OMP_NUM_THREADS": "1",
                "HF_HOME": str(home),
                "HF_HUB_OFFLINE": "1",
                "MEMTRAIN_CACHE_DIR": str(cache),
            }
            keep = None if json_dir is None else json_dir / f"{len(results):02d}.json"
            results[name] = plan_once(argv, env, keep)
            if keep is not None:
                results[name]["json"] = str(keep)
            if warm:
                results[name]["warm_cpu_s"] = plan_once(argv, env)["cpu_s"]
            row = results[name]
            print(f"{name}: {row['cpu_s']:.1f} s CPU, peak {row['peak']}", file=sys.stderr, flush=True)
    return results


def _gib(peak: int | None) -> str:
    return "no plan fits" if peak is None else f"{peak / 2**30:.2f} GiB"


def compare(before: dict[str, Any], after: dict[str, Any]) -> str:
    lines = [
        "| recipe / what-if | CPU s before | CPU s after | after, warm cache | peak before | peak after | plan |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, new in after.items():
        old = before.get(name, {})
        same = "same" if old.get("chosen") == new["chosen"] else "**differs**"
        if "json" in old and "json" in new:
            same += ", --json " + ("identical" if _same_file(old["json"], new["json"]) else "**differs**")
        warm = f"{new['warm_cpu_s']:.1f}" if "warm_cpu_s" in new else "-"
        lines.append(
            f"| {name} | {old.get('cpu_s', float('nan')):.1f} | {new['cpu_s']:.1f} | {warm} | "
            f"{_gib(old.get('peak'))} | {_gib(new['peak'])} | {same} |"
        )
    return "\n".join(lines)


def _same_file(a: str, b: str) -> bool:
    """Whether two kept --json files are the same text but for the mesh search's `search_seconds` line (its
    own timing)."""
    if not (Path(a).is_file() and Path(b).is_file()):
        return False
    texts = (Path(path).read_text().splitlines() for path in (a, b))
    kept = [[line for line in lines if '"search_seconds":' not in line] for lines in texts]
    return kept[0] == kept[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the src tree to time (default: ours)")
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    parser.add_argument("--only", default="", help="time only the cases whose name contains this")
    parser.add_argument("--warm", action="store_true", help="plan each case again on the cache it left")
    parser.add_argument("--json-dir", type=Path, help="keep each cold plan's --json in this directory")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), help="print the table")
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(compare(before, after))
        return
    if args.json_dir:
        args.json_dir.mkdir(parents=True, exist_ok=True)
    results = run(args.src.resolve(), args.only, args.warm, args.json_dir)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(compare(results, results))


if __name__ == "__main__":
    main()
