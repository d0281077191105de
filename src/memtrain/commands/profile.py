"""`memtrain profile`: train a few steps with the full memory tracker and write what it saw.

Outputs in `--out`: `memory.json` (the schema of `memtrain.memory.report.memory_json`, plus the first-step
explanation, `ranks`: every rank's components at its peak and its mesh coordinates, and, on CUDA, the
allocator's view), `timeline.png` and `timeline.html` (stacked components
over the steps, phases marked, peak annotated), `memory_snapshot.pickle` on CUDA (open it in
https://pytorch.org/memory_viz), and a table of the components at the peak on stdout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memtrain import json_out
from memtrain.commands.trainers import for_recipe, load_checked_recipe, trainer_class
from memtrain.distributed import DistEnv, gather_objects, local_device
from memtrain.memory import cuda_stats
from memtrain.memory.allocator_check import AllocatorModelCheck, check_recorded_run
from memtrain.memory.report import format_table, memory_json, write_timeline_html, write_timeline_png
from memtrain.memory.values import StepMemory, format_bytes
from memtrain.run import RunLayout

PROFILE_OVERRIDES = [
    "checkpoint.every=0",
    "checkpoint.at_end=false",
    "train.eval_every=0",
    "memory.track=true",
]


def run_profile(
    recipe_path: str, overrides: list[str], steps: int, out: Path | None, trainer_spec: str | None = None
) -> tuple[dict[str, Any], Path]:
    """Train `steps` steps of the recipe under the tracker with the built-in trainer or `trainer_spec`
    (`--trainer FILE.py:Class`); returns (memory.json content, output dir)."""
    trainer_cls = trainer_class(trainer_spec)
    probe = load_checked_recipe(recipe_path, overrides, trainer_cls)
    out_dir = out or RunLayout(probe.output_path()).profile_dir
    recipe = trainer_cls.recipe_class.load(
        recipe_path, [*overrides, f"train.steps={steps}", f"run.output_dir={out_dir}", *PROFILE_OVERRIDES]
    )
    # The history starts before the trainer: the allocator model's replay needs every request of the run,
    # on the trainer's own device (made current first, as `init_distributed` will, so nothing lands on GPU 0).
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stats = cuda_stats.allocator_stats(device)
    held_at_start = stats.reserved_bytes if stats is not None else 0
    cuda_stats.start_memory_history()
    trainer = for_recipe(trainer_cls, recipe)(recipe)
    on_cuda = trainer.env.device.type == "cuda"
    trainer.fit()
    monitor = trainer.monitor
    tracker = monitor.tracker
    assert tracker is not None
    report = memory_json(monitor.memory_reports, trainer.env.device)
    report["ranks"] = gather_objects(_this_rank(trainer.env, monitor.memory_reports), trainer.env)
    if len(monitor.memory_reports) >= 2:
        device_peaks = monitor.device_peaks if on_cuda else None  # RSS is no per-tensor peak on CPU
        report["first_step"] = tracker.first_step_report(device_peaks)
    if on_cuda:
        model_check = check_recorded_run(trainer.env.device, held_at_start)
        snapshot = cuda_stats.dump_memory_history(out_dir / "memory_snapshot.pickle")
        stats = cuda_stats.allocator_stats(trainer.env.device)
        report["cuda"] = {
            "allocator": stats.__dict__ if stats is not None else None,
            "allocator_model": model_check.__dict__ if model_check is not None else None,
            "context_bytes": cuda_stats.context_bytes(trainer.env.device),
            "snapshot": snapshot.detail,
            "fragmentation_warning": cuda_stats.fragmentation_warning(stats),
        }
    if trainer.env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "memory.json").write_text(json_out.dumps(report, indent=2))
        write_timeline_png(tracker, out_dir / "timeline.png", monitor.memory_reports)
        write_timeline_html(tracker, out_dir / "timeline.html", monitor.memory_reports)
    return report, out_dir


def _this_rank(env: DistEnv, reports: list[StepMemory]) -> dict[str, Any]:
    """This rank's components at its own peak (the last step's) and where it sits on the mesh."""
    last = reports[-1] if reports else None
    return {
        "rank": env.rank,
        "coordinates": env.shape.coordinates(env.rank),
        "peak_bytes": last.peak_bytes if last is not None else None,
        "at_peak": dict(last.at_peak) if last is not None else None,
    }


def describe(report: dict[str, Any], out_dir: Path) -> str:
    lines = [format_table(report), ""]
    for line in report.get("first_step", {}).get("explanation", []):
        lines.append(f"first step: {line}")
    model_check = (report.get("cuda") or {}).get("allocator_model")
    if model_check is not None:
        lines.append(allocator_model_line(AllocatorModelCheck(**model_check)))
    lines.append(f"wrote {out_dir}/memory.json, timeline.png, timeline.html")
    return "\n".join(lines)


def allocator_model_line(check: AllocatorModelCheck) -> str:
    """One line on memtrain's allocator model replayed over this run's requests (the planner's reserved bytes
    stand on it), or why it was not."""
    if check.reason is not None or check.replayed_reserved_bytes is None:
        return f"allocator model: not replayed ({check.reason})"
    return (
        f"allocator model: this run's requests replayed to {format_bytes(check.replayed_reserved_bytes)} "
        f"reserved, the allocator reserved {format_bytes(check.reserved_bytes)} "
        f"({check.reserved_error or 0.0:+.2%}); live blocks at the end {format_bytes(check.replayed_allocated_bytes or 0)}"
        f" replayed, {format_bytes(check.allocated_bytes)} allocated"
    )
