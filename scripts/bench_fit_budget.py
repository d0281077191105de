"""What fits under a memory budget, and how fast, with HF Trainer, accelerate and memtrain (issue 16).

Why: memtrain's claim against what people run today is "more fits in the memory you have, at equal or
better speed". Two modes measure it:

- CUDA (default): a ~1.1B Llama on a GPU made to look like a 24, 40 and 80 GiB device; the largest
  micro-batch each tool trains and its tokens/s (fit_kit/cuda_mode.py). Without CUDA it prints
  "skipped: needs CUDA" and exits 0; `--cpu-smoke` runs its code paths on the CPU with no budget.
- CPU (`--cpu`): every tool under memtrain's simulated budget (a real torch.OutOfMemoryError past n
  counted bytes), at budgets of 20-100% of the unconstrained peak (fit_kit/cpu_mode.py). Tools: HF
  Trainer `auto_find_batch_size` with and without gradient checkpointing, the "expert" HF configuration
  (checkpointing + 8-bit AdamW + bf16), an accelerate loop with `find_executable_batch_size` with and
  without checkpointing, and memtrain `strategies: auto`; every tool clips gradients at 1.0 (memtrain's
  step in backward clips with two passes; `--tools memtrain-noclip` adds the same job without clipping);
  the same model, data, seed and global batch, each tool in its own process. Metrics, each found by the same bisection for every tool:
  (a) the largest model (width and depth scaled together, fixed sequence length) that trains at all;
  (b) tokens/s at the fixed global batch with the largest micro-batch that fits (median and spread over
      --reps timed runs), each tool's own search reported beside it;
  (c) the longest sequence that trains.

    # the full CPU run (~7M-parameter base, 5 budgets, 3 rounds of timed runs; see docs/BENCHMARKS.md)
    .venv/bin/python scripts/bench_fit_budget.py --cpu --json results/fit_cpu.json --markdown results/fit_cpu.md
    # the quick variant (~1M base, 3 budgets, 2 rounds): about 10 minutes on an idle 2-core machine
    .venv/bin/python scripts/bench_fit_budget.py --cpu --quick --json results/fit_cpu_quick.json
    # the CUDA run (scripts/gpu_check.sh runs it)
    .venv/bin/python scripts/bench_fit_budget.py [--budgets 24,40,80] [--time-budget 240] [--json results/fit.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_vs_peers import write_report
from fit_kit import cpu_report, cuda_mode
from fit_kit.cpu_setup import BASES, DEFAULT_TOOLS, TOOLS, CpuSetup

CPU_BUDGETS = {"full": "20,40,60,80,100", "quick": "20,60,100"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the CPU benchmark under the simulated budget")
    p.add_argument("--quick", action="store_true", help="with --cpu: the ~1M base, 3 budgets, 2 rounds")
    p.add_argument(
        "--budgets",
        default=None,
        help="comma-separated, increasing: GiB on CUDA (default 24,40,80); with --cpu, percent of the "
        f"unconstrained peak (default {CPU_BUDGETS['full']}, quick {CPU_BUDGETS['quick']})",
    )
    p.add_argument(
        "--model",
        choices=(*cuda_mode.MODELS, *BASES),
        default=None,
        help=f"CUDA: {', '.join(cuda_mode.MODELS)} (default llama-1.1b); --cpu: the base of the ladder, "
        f"{', '.join(BASES)} (default llama-7m, quick llama-1m, tiny: the smoke test)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 on CUDA; --cpu: the base's")
    p.add_argument("--global-batch", type=int, default=None, help="--cpu: sequences a step (the base's)")
    p.add_argument("--max-seq", type=int, default=None, help="--cpu: the longest sequence (c) tries")
    p.add_argument(
        "--steps", type=int, default=None, help="CUDA: steps per probe (3); --cpu: timed steps per run (3)"
    )
    p.add_argument("--reps", type=int, default=None, help="--cpu: rounds of timed runs (3, quick 2)")
    p.add_argument(
        "--tools",
        default=",".join(DEFAULT_TOOLS),
        help="--cpu: comma-separated subset of " + ",".join(TOOLS) + " (default: all that clip)",
    )
    p.add_argument("--threads", type=int, default=1, help="--cpu: torch threads per worker (default 1)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="--cpu: every tool in this process (the smoke test; the figures lose the isolation)",
    )
    p.add_argument("--time-budget", type=float, default=240.0, help="CUDA: seconds for all probes together")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the CUDA mode's code paths on the CPU with no budget (tests; the figures mean nothing)",
    )
    p.add_argument("--worker", choices=cuda_mode.TOOLS, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--worker-task", help=argparse.SUPPRESS)
    return p


def cpu_setup(args: argparse.Namespace, p: argparse.ArgumentParser) -> CpuSetup:
    base = args.model or ("llama-1m" if args.quick else "llama-7m")
    if base not in BASES:
        p.error(f"--model: with --cpu one of {', '.join(BASES)} (got {base})")
    shape = BASES[base]
    try:
        budgets = tuple(
            int(b) for b in (args.budgets or CPU_BUDGETS["quick" if args.quick else "full"]).split(",")
        )
    except ValueError:
        p.error("--budgets: with --cpu, comma-separated whole percentages such as 20,60,100")
    if list(budgets) != sorted(set(budgets)) or not all(0 < b <= 1000 for b in budgets):
        p.error("--budgets: increasing percentages above 0, such as 20,60,100")
    ladder = {k: shape[k] for k in ("min_seq", "min_rung", "max_rung") if k in shape}
    setup = CpuSetup(
        base=base,
        seq_len=args.seq_len or shape["seq_len"],
        global_batch=args.global_batch or shape["global_batch"],
        max_seq=args.max_seq or shape["max_seq"],
        **ladder,
        budgets=budgets,
        steps=args.steps or 3,
        threads=args.threads,
    )
    if min(setup.seq_len, setup.global_batch, setup.steps, setup.threads) < 1:
        p.error("--seq-len, --global-batch, --steps and --threads must be at least 1")
    return setup


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if not args.cpu:
        args.budgets = args.budgets or "24,40,80"
        args.model = args.model or "llama-1.1b"
        if args.model not in cuda_mode.MODELS:
            p.error(f"--model: without --cpu one of {', '.join(cuda_mode.MODELS)} (got {args.model})")
        args.seq_len = args.seq_len or 4096
        args.steps = args.steps or 3
        cuda_mode.run(args)
        return
    from fit_kit import cpu_mode

    if args.worker_task:
        cpu_mode.worker_main(args.worker_task)
        return
    setup = cpu_setup(args, p)
    tools = [t for t in args.tools.split(",") if t]
    if not tools or any(t not in TOOLS for t in tools):
        p.error(f"--tools: a comma-separated subset of {','.join(TOOLS)}")
    reps = args.reps if args.reps is not None else (2 if args.quick else 3)
    result = cpu_mode.run_cpu(setup, tools, reps, in_process=args.in_process)
    result["command"] = " ".join(["scripts/bench_fit_budget.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [*cpu_report.tables(result), "", f"- `{result['command']}`: {result['seconds']:.0f} s."]
    write_report(lines, result, args.markdown, args.json)


if __name__ == "__main__":
    main()
