"""memtrain's step time vs a hand-written PyTorch loop: same model, data, optimizer, fp32, no strategies.

Also measured: the per-step cost of the always-on metrics (step peak memory + a JSONL row) as a fraction
of the step (goal <= 2%), and the slowdown of the full memory tracker (off unless asked for).

Both train the default recipe's model on the same batches in the same process; rounds interleave
the two (alternating which goes first) so drifts in machine load hit both alike. Reports the median
over rounds of (memtrain seconds per step) / (hand-loop seconds per step). Goal: <= 1.02.

    .venv/bin/python scripts/bench_overhead.py [--rounds 7] [--steps 30] [--json results/overhead.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.loggers import JsonlLogger, LoggerContext
from memtrain.memory import StepPeak

REPO = Path(__file__).resolve().parent.parent


def memtrain_seconds_per_step(steps: int, out: Path) -> float:
    recipe = CausalLMRecipe.load(
        REPO / "recipes/default.yaml",
        [
            f"train.steps={steps}",
            f"run.output_dir={out}",
            "checkpoint.at_end=false",
            "checkpoint.every=0",
            "train.eval_every=0",
            "output.progress=off",
        ],
    )
    trainer = CausalLMTrainer(recipe)
    trainer.setup()
    start = time.perf_counter()
    trainer.fit()
    return (time.perf_counter() - start) / steps


def hand_loop_seconds_per_step(steps: int, out: Path) -> float:
    """What a user would write by hand: mean cross-entropy, backward, clip, AdamW step."""
    recipe = CausalLMRecipe.load(REPO / "recipes/default.yaml", [f"run.output_dir={out}"])
    data = CausalLMTrainer(recipe)  # only its model and batches; its loop is not used
    torch.manual_seed(recipe.run.seed)
    model = data.build_model()
    t = recipe.train
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
    )
    start = time.perf_counter()
    for step in range(steps):
        batch = data.step_batch(step)
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
    return (time.perf_counter() - start) / steps


def always_on_metrics_seconds(repeats: int = 2000) -> float:
    """Per-step cost of what `train` always records: the step peak (allocator peak on CUDA, per-step
    peak RSS on CPU) and one JSONL row."""
    peak = StepPeak(torch.device("cpu"))
    row = {
        "step": 1,
        "loss": 1.0,
        "lr": 1e-3,
        "tokens": 2048,
        "tokens_per_s": 1.0,
        "step_time_s": 0.1,
        "grad_norm": 1.0,
        "skipped": False,
        "micro_batches": 1,
        "peak_memory_bytes": 1,
    }
    with tempfile.TemporaryDirectory() as tmp:
        log = JsonlLogger(
            LoggerContext(Path(tmp) / "m.jsonl", Path(tmp) / "r.json", Path(tmp), "bench", {}, None)
        )
        start = time.perf_counter()
        for _ in range(repeats):
            peak.start()
            row["peak_memory_bytes"] = peak.stop()
            log.log(1, row)
        elapsed = time.perf_counter() - start
        log.close()
    return elapsed / repeats


def tracked_seconds_per_step(steps: int, out: Path) -> float:
    """The full tracker (`memtrain profile`, `memory.track`), for comparison: not on by default."""
    recipe = CausalLMRecipe.load(
        REPO / "recipes/default.yaml",
        [
            f"train.steps={steps}",
            f"run.output_dir={out}",
            "checkpoint.at_end=false",
            "checkpoint.every=0",
            "train.eval_every=0",
            "output.progress=off",
            "memory.track=true",
        ],
    )
    trainer = CausalLMTrainer(recipe)
    trainer.setup()
    start = time.perf_counter()
    trainer.fit()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    ratios, ours, theirs = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        hand_loop_seconds_per_step(3, Path(tmp) / "warm")  # warm-up: first-call costs hit neither side
        for r in range(args.rounds):
            if r % 2 == 0:  # alternate which side runs first so neither always follows the other
                a = memtrain_seconds_per_step(args.steps, Path(tmp) / f"m{r}")
                b = hand_loop_seconds_per_step(args.steps, Path(tmp) / f"h{r}")
            else:
                b = hand_loop_seconds_per_step(args.steps, Path(tmp) / f"h{r}")
                a = memtrain_seconds_per_step(args.steps, Path(tmp) / f"m{r}")
            ours.append(a)
            theirs.append(b)
            ratios.append(a / b)
            print(
                f"round {r + 1}: memtrain {a * 1000:.1f} ms/step, hand loop {b * 1000:.1f} ms/step, ratio {a / b:.3f}"
            )
        tracked = tracked_seconds_per_step(max(args.steps // 3, 3), Path(tmp) / "tracked")
    metrics_cost = always_on_metrics_seconds()
    result = {
        "median_ratio": statistics.median(ratios),
        "always_on_metrics_ms_per_step": metrics_cost * 1000,
        "always_on_metrics_fraction_of_step": metrics_cost / statistics.median(ours),
        "tracker_ms_per_step": tracked * 1000,
        "tracker_slowdown": tracked / statistics.median(ours),
        "memtrain_ms_per_step": statistics.median(ours) * 1000,
        "hand_loop_ms_per_step": statistics.median(theirs) * 1000,
        "rounds": args.rounds,
        "steps": args.steps,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
