"""Replay GPU runs others published as memtrain what-ifs, every lever pinned to the source's configuration
(issue 39), and compare the predicted peak with the published one on the source's own counter.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_published.py [--only TEXT] [--json results/published.json]

Why: memtrain's predictions were only ever checked against memtrain (its tracker on CPU). A user compares our
what-if with the run a colleague published; a refusal of what they trained, or a figure far from theirs, is
what they see first. Each row names its source, the counter the source reports (torch's reserved peak, or
its allocated / "active" peak, which is what memtrain's tracker counts), the unit it printed (GB is 10^9
bytes, GiB 2^30), and whether the run trained. A row whose source used a lever memtrain has no equivalent of
(torch.compile, float8 linears, async tensor parallel) is printed and not counted: its error says as much
about the lever as about the model. The counted rows are the acceptance: |error| <= 5% and memtrain's fit
verdict the same as the source's.

Rows come from the sources' own tables and the config files behind them (read for precision policy,
recompute policy, optimizer implementation, loss, batch and sequence); the recipes are under
recipes/published/ and recipes/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from bench_mesh_plan import LLAMA8B, LLAMA70B, LLAMA405B, _mesh  # the same recipes and mesh overrides

from memtrain.commands.plan import _at_sequence, _spec
from memtrain.commands.trainers import for_recipe, load_checked_recipe, trainer_class
from memtrain.errors import MemtrainError
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.planner import plan_meshes, plan_what_if
from memtrain.planner.mesh_search import searches_meshes
from memtrain.planner.prediction_error import MeasuredError, write_measured_error

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
UNIT_BYTES = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20}
UNBOUNDED = 2**50  # the card the what-ifs are scored on (then held to the real one)
TORCHTITAN = "torchtitan docs/benchmarks (H100 96 GB, reserved peak)"
TORCHTUNE_3B = "torchtune README, Llama 3.2 3B one lever at a time (A100 80 GB, active peak)"


@dataclass(frozen=True)
class Row:
    """One published run and the memtrain recipe that pins its levers."""

    name: str
    source: str
    recipe: str
    overrides: tuple[str, ...]
    world: int
    gpu: str
    published: float | None  # as the source printed it, in `unit`; None: the source says only whether it ran
    unit: str  # GiB, GB or MiB
    counter: str  # "reserved" (torch's reserved peak), "allocated" (its allocated / active peak) or "device"
    trained: bool = True  # False: the source reports the run out of memory
    unmodelled: tuple[str, ...] = ()  # the source's levers memtrain has no equivalent of: row not counted

    @property
    def published_bytes(self) -> int | None:
        return None if self.published is None else int(self.published * UNIT_BYTES[self.unit])


@dataclass(frozen=True)
class Outcome:
    """What memtrain predicts for a row: allocated and reserved peak of the busiest rank, and its verdict."""

    allocated: int
    reserved: int | None
    fits: bool
    usable: int
    refused: str = ""  # a one-line reason when no plan could be scored at all
    seconds: float = 0.0
    outside_allocator: int = 0  # the CUDA context and NCCL's reserve: what nvidia-smi shows beyond torch

    def on(self, counter: str) -> int:
        """The prediction on a counter: torch's allocated or reserved peak, or the device's ("device": what
        nvidia-smi and the loggers' system metrics show, the reserved bytes plus what lives outside torch's
        allocator)."""
        if counter == "allocated" or self.reserved is None:
            return self.allocated
        return self.reserved + (self.outside_allocator if counter == "device" else 0)


LLAMA3B = "recipes/published/llama3.2-3b.yaml"
LLAMA8B_TUNE = "recipes/published/llama3.1-8b.yaml"
TORCHTUNE_8B = "torchtune README, Llama 3.1 8B on one RTX 4090 (batch 2 packed to 2048, compiled; peak GiB)"
# torchtune's llama3_1 8B LoRA / QLoRA single-device configs: rank 8, alpha 16, q/v/output projections and the
# MLP, the whole model in bf16 (adapters too), full recompute, chunked loss, AdamW(fused=True).
TUNE_LORA = (
    "adapters.kind=lora",
    "adapters.r=8",
    "adapters.alpha=16",
    "adapters.dropout=0.0",
    "adapters.target_modules=[q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
)
# torchtitan's llama3 8B/70B tomls: bf16 compute, fp32 params and reduce (FSDP2 MixedPrecisionPolicy),
# AdamW (foreach), cross-entropy on fp32 logits, seq 8192.
TITAN = ("strategies.precision=bf16-mixed", "strategies.sharding=zero3", "strategies.loss=standard")
# torchtune's 3B full single-device recipe: pure bf16 params, torch AdamW(fused=True), packed 2 x 4096.
TUNE = (
    "strategies.precision=bf16-true",
    "strategies.sharding=none",
    "batch.micro_size=2",
    "batch.global_size=2",
)

ROWS: tuple[Row, ...] = (
    Row(
        "torchtitan 8B, FSDP 8, local batch 2, selective (op)",
        TORCHTITAN,
        LLAMA8B,
        (
            *TITAN,
            "strategies.checkpointing=selective-op",
            "batch.micro_size=2",
            "batch.global_size=16",
            *_mesh(dp_shard=8),
        ),
        8,
        "h100-96gb",
        82.4,
        "GiB",
        "reserved",
    ),
    Row(
        "torchtitan 8B, FSDP 128, local batch 2, selective (op)",
        TORCHTITAN,
        LLAMA8B,
        (
            *TITAN,
            "strategies.checkpointing=selective-op",
            "batch.micro_size=2",
            "batch.global_size=256",
            *_mesh(dp_shard=128),
        ),
        128,
        "h100-96gb",
        67.0,
        "GiB",
        "reserved",
    ),
    Row(
        "torchtitan 70B, FSDP 32 x TP 8 (SP), local batch 16, full",
        TORCHTITAN,
        LLAMA70B,
        (
            *TITAN,
            "strategies.checkpointing=full",
            "data.seq_len=8192",
            "batch.micro_size=16",
            "batch.global_size=512",
            *_mesh(dp_shard=32, tp=8),
        ),
        256,
        "h100-96gb",
        71.9,
        "GiB",
        "reserved",
        unmodelled=("torch.compile", "float8 linears"),
    ),
    *(
        Row(
            f"torchtitan 8B, FSDP {8 // c} x CP {c}, seq {32768 * c // 1024}k, batch 1, full",
            TORCHTITAN,
            LLAMA8B,
            (
                *TITAN,
                "strategies.checkpointing=full",
                f"data.seq_len={32768 * c}",
                "model.config.max_position_embeddings=262144",
                "batch.micro_size=1",
                f"batch.global_size={8 // c}",
                *_mesh(dp_shard=8 // c, cp=c),
            ),
            8,
            "h100-96gb",
            published,
            "GiB",
            "reserved",
            unmodelled=("torch.compile", "float8 linears"),
        )
        for c, published in ((1, 83.9), (2, 84.2), (4, 84.0), (8, 84.5))
    ),
    Row(
        "torchtune 3B, packed 2 x 4096, no recompute",
        TORCHTUNE_3B,
        LLAMA3B,
        (*TUNE, "strategies.checkpointing=none", "strategies.loss=standard"),
        1,
        "a100-80gb",
        60.0,
        "GiB",
        "allocated",
    ),
    Row(
        "torchtune 3B, + compile + chunked loss",
        TORCHTUNE_3B,
        LLAMA3B,
        (*TUNE, "strategies.checkpointing=none", "strategies.loss=chunked"),
        1,
        "a100-80gb",
        42.9,
        "GiB",
        "allocated",
        unmodelled=("torch.compile",),
    ),
    Row(
        "torchtune 3B, + full recompute",
        TORCHTUNE_3B,
        LLAMA3B,
        (*TUNE, "strategies.checkpointing=full", "strategies.loss=chunked"),
        1,
        "a100-80gb",
        24.9,
        "GiB",
        "allocated",
        unmodelled=("torch.compile",),
    ),
    Row(
        "torchtune 3B, + optimizer step in backward",
        TORCHTUNE_3B,
        LLAMA3B,
        (
            *TUNE,
            "strategies.checkpointing=full",
            "strategies.loss=chunked",
            "strategies.optimizer_step=in_backward",
        ),
        1,
        "a100-80gb",
        23.1,
        "GiB",
        "allocated",
        unmodelled=("torch.compile",),
    ),
    Row(
        "torchtune 3B, + activation offload",
        TORCHTUNE_3B,
        LLAMA3B,
        (
            *TUNE,
            "strategies.checkpointing=offload",
            "strategies.loss=chunked",
            "strategies.optimizer_step=in_backward",
        ),
        1,
        "a100-80gb",
        21.8,
        "GiB",
        "allocated",
        unmodelled=("torch.compile",),
    ),
)


TORCHTITAN_OLD = "torchtitan's older docs (H100 96 GB; whether it ran, no figure)"
TORCHTITAN_H200 = "torchtitan benchmarks/llama3_8b_h200_2025-06 (Trainy; H200, reserved peak at step 100)"
COMPILED_FLOAT8 = ("torch.compile", "float8 linears", "float8 all-gather")
ROWS += (
    *(
        Row(
            f"torchtitan 8B, FSDP {world}, local batch 2, selective (op), compiled",
            TORCHTITAN,
            LLAMA8B,
            (
                *TITAN,
                "strategies.checkpointing=selective-op",
                "batch.micro_size=2",
                f"batch.global_size={2 * world}",
                *_mesh(dp_shard=world),
            ),
            world,
            "h100-96gb",
            published,
            "GiB",
            "reserved",
            unmodelled=("torch.compile",),
        )
        for world, published in ((8, 77.0), (128, 62.0))
    ),
    *(
        Row(
            f"torchtitan 8B, FSDP {world} on H200, local batch 2, selective (op), compiled, float8",
            TORCHTITAN_H200,
            LLAMA8B,
            (
                *TITAN,
                "strategies.checkpointing=selective-op",
                "batch.micro_size=2",
                f"batch.global_size={2 * world}",
                *_mesh(dp_shard=world),
            ),
            world,
            "h200-141gb",
            published,
            "GiB",
            "reserved",
            unmodelled=COMPILED_FLOAT8,
        )
        for world, published in ((32, 47.96), (64, 46.97))
    ),
    Row(
        "torchtitan 405B, FSDP 128 (1-D), batch 1, full: ran out of memory",
        TORCHTITAN_OLD,
        LLAMA405B,
        (*TITAN, "strategies.checkpointing=full", "batch.global_size=128", *_mesh(dp_shard=128, tp=1, pp=1)),
        128,
        "h100-96gb",
        None,
        "GiB",
        "reserved",
        trained=False,
    ),
    Row(
        "torchtitan 405B, FSDP 16 x TP 8, batch 2, full: trained",
        TORCHTITAN_OLD,
        LLAMA405B,
        (
            *TITAN,
            "strategies.checkpointing=full",
            "batch.micro_size=2",
            "batch.global_size=32",
            *_mesh(dp_shard=16, tp=8, pp=1),
        ),
        128,
        "h100-96gb",
        None,
        "GiB",
        "reserved",
    ),
    *(
        Row(
            f"torchtitan 405B, FSDP 8 x TP 8 x PP 8, {schedule}",
            TORCHTITAN,
            LLAMA405B,
            (
                *TITAN,
                "strategies.checkpointing=full",
                f"batch.micro_size={rows}",
                "batch.global_size=256",
                *_mesh(dp_shard=8, tp=8, pp=8, pp_schedule=schedule),
            ),
            512,
            "h100-96gb",
            published,
            "GiB",
            "reserved",
            unmodelled=(*COMPILED_FLOAT8, "async TP"),
        )
        for schedule, rows, published in (("1f1b", 4, 82.5), ("interleaved_1f1b", 2, 72.7))
    ),
    Row(
        "torchtune 8B full fine-tune, 8-bit paged AdamW, step in backward",
        TORCHTUNE_8B,
        LLAMA8B_TUNE,
        ("strategies.optimizer_states=paged-8bit", "strategies.optimizer_step=in_backward"),
        1,
        "rtx4090-24gb",
        18.9,
        "GiB",
        "allocated",
        unmodelled=("torch.compile",),
    ),
    Row(
        "torchtune 8B LoRA",
        TORCHTUNE_8B,
        LLAMA8B_TUNE,
        TUNE_LORA,
        1,
        "rtx4090-24gb",
        16.2,
        "GiB",
        "allocated",
        unmodelled=("torch.compile",),
    ),
    Row(
        "torchtune 8B QLoRA (nf4)",
        TORCHTUNE_8B,
        LLAMA8B_TUNE,
        (*TUNE_LORA, "model.quantization=nf4", "model.double_quant=true"),
        1,
        "rtx4090-24gb",
        7.4,
        "GiB",
        "allocated",
        unmodelled=("torch.compile",),
    ),
)


PEFT = "Hugging Face PEFT docs (accelerate guides; GB per GPU as the device shows it)"
QLORA70B, LORA70B = "recipes/llama2-70b-qlora-fsdp-2gpu.yaml", "recipes/llama2-70b-lora-8xh100.yaml"
ROWS += (
    Row("PEFT 70B QLoRA, FSDP on 2 x 80 GB", PEFT, QLORA70B, (), 2, "h100-80gb", 35.6, "GB", "device"),
    Row(
        "PEFT 70B QLoRA, FSDP + CPU offload on 2 x 24 GB",
        PEFT,
        QLORA70B,
        ("strategies.sharding_offload=params",),
        2,
        "rtx4090-24gb",
        19.6,
        "GB",
        "device",
    ),
    Row(
        "PEFT 70B QLoRA, DeepSpeed ZeRO-3 on 2 x 80 GB",
        PEFT,
        QLORA70B,
        ("strategies.sharding_backend=deepspeed",),
        2,
        "h100-80gb",
        36.6,
        "GB",
        "device",
        unmodelled=("DeepSpeed ZeRO-3 over a 4-bit base",),
    ),
    Row(
        "PEFT 70B LoRA, DeepSpeed ZeRO-3 on 8 x 80 GB",
        PEFT,
        LORA70B,
        (),
        8,
        "h100-80gb",
        64.0,
        "GB",
        "device",
    ),
)


def predict(row: Row) -> Outcome:
    """The row's what-if through the code `memtrain plan` runs: the mesh search for a mesh of more than one
    dimension, the one-device planner (on `world` data-parallel ranks) otherwise. It plans for a card of
    `UNBOUNDED` bytes, so that the pinned plan is scored whole (allocated and reserved) even where it does not
    fit, then holds what it requires to the real card's usable bytes, as the search does."""
    started = time.perf_counter()
    trainer = trainer_class(None)
    path = str(REPO / row.recipe)
    recipe = load_checked_recipe(path, list(row.overrides), trainer)
    gpu = load_gpu(row.gpu)
    real = what_if_target(row.world, gpu, None, recipe.planner.safety_fraction).budget
    usable = real.usable
    outside = gpu.cuda_context_bytes + real.reserve
    quiet: Callable[[str], None] = lambda _line: None  # noqa: E731
    if searches_meshes(recipe, True):
        target = what_if_target(row.world, gpu, UNBOUNDED, recipe.planner.safety_fraction)
        found = plan_meshes(
            recipe,
            _spec(trainer, recipe),
            replace(target, mesh=None),
            gpu.cluster,
            spec_at=lambda seq: _spec(trainer, _at_sequence(path, list(row.overrides), trainer, seq)),
            progress=quiet,
        )
        best = found.chosen or found.best_misfit
        if best is None:
            reason = "; ".join(f"{mesh}: {why}" for mesh, why in found.excluded) or "no mesh scored"
            return Outcome(0, None, False, usable, refused=reason, seconds=time.perf_counter() - started)
        return Outcome(
            best.peak,
            best.reserved,
            best.required <= usable,
            usable,
            seconds=time.perf_counter() - started,
            outside_allocator=outside,
        )
    spec = for_recipe(trainer, recipe)(recipe).model_spec()
    try:
        result = plan_what_if(recipe, spec, row.world, gpu=gpu, memory_bytes=UNBOUNDED, progress=quiet)
    except MemtrainError as exc:  # refused before any plan was scored: the one line is the answer
        return Outcome(
            0, None, False, usable, refused=str(exc).splitlines()[0], seconds=time.perf_counter() - started
        )
    assert result.chosen is not None
    prediction = result.chosen.prediction
    return Outcome(
        prediction.peak,
        prediction.reserved,
        prediction.required <= usable,
        usable,
        seconds=time.perf_counter() - started,
        outside_allocator=outside,
    )


def error(row: Row, outcome: Outcome) -> float | None:
    """Signed relative error of the prediction on the source's counter (None: no figure published)."""
    published = row.published_bytes
    return None if published is None else outcome.on(row.counter) / published - 1.0


def measured(records: list[dict[str, Any]]) -> MeasuredError:
    """The counted rows' largest under-prediction ((published - predicted) / predicted) and over-prediction,
    on torch's own counters only: the margin is added to torch's reserved bytes, and a device figure
    (nvidia-smi) adds what the source's stack keeps outside torch's allocator, which memtrain's plan does
    not run."""
    ratios = [
        r["row"]["published"] * UNIT_BYTES[r["row"]["unit"]] / r["predicted_on_counter"] - 1.0
        for r in records
        if r["counted"]
        and r["predicted_on_counter"] > 0
        and r["row"]["published"] is not None
        and r["row"]["counter"] != "device"
    ]
    return MeasuredError(
        under_prediction=round(max([0.0, *ratios]), 4),
        over_prediction=round(max([0.0, *(-x for x in ratios)]), 4),
        runs=len(ratios),
        source=f"scripts/bench_published.py --write-error, {datetime.date.today()}: what-ifs of published GPU runs",
    )


def markdown_row(row: Row, outcome: Outcome) -> str:
    published = "-" if row.published_bytes is None else f"{row.published_bytes / GiB:.1f}"
    signed = error(row, outcome)
    counted = "no (" + ", ".join(row.unmodelled) + ")" if row.unmodelled else "yes"
    if outcome.refused:
        agrees = "**no**" if row.trained else "yes"
        return f"| {row.name} | {row.counter} | {published} | - | - | - | refused: {outcome.refused} | {agrees} | {counted} |"
    reserved = f"{outcome.reserved / GiB:.1f}" if outcome.reserved is not None else "-"
    verdict = "fits" if outcome.fits else "does not fit"
    agrees = "yes" if outcome.fits == row.trained else "**no**"
    return (
        f"| {row.name} | {row.counter} | {published} | {outcome.allocated / GiB:.1f} | {reserved} | "
        f"{'-' if signed is None else f'{100 * signed:+.1f}%'} | {verdict} | {agrees} | {counted} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="replay only the rows whose name contains this text")
    parser.add_argument("--json", type=Path, help="also write the rows and outcomes here")
    parser.add_argument(
        "--write-error",
        action="store_true",
        help="write the counted rows' largest under- and over-prediction to planner/prediction_error.json "
        "(planner.reserved_margin's default); needs every row (no --only)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for row in ROWS if args.only.lower() in row.name.lower()]
    if not rows:
        print(f"--only {args.only!r}: no row matches", file=sys.stderr)
        return 2
    print(
        "| run | counter | published GiB | predicted allocated GiB | predicted reserved GiB | error | memtrain says "
        "| agrees with the run | counted |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    records: list[dict[str, Any]] = []
    misses = 0
    for row in rows:
        outcome = predict(row)
        print(markdown_row(row, outcome), flush=True)
        counted = not row.unmodelled
        signed = error(row, outcome)
        close = signed is None or abs(signed) <= 0.05
        within = not outcome.refused and close and outcome.fits == row.trained
        misses += int(counted and not within)
        records.append(
            {
                "row": asdict(row),
                "outcome": asdict(outcome),
                "predicted_on_counter": outcome.on(row.counter),
                "counted": counted,
                "within": within,
            }
        )
    counted_rows = sum(1 for row in rows if not row.unmodelled)
    print(f"\ncounted rows within 5% and agreeing on fit: {counted_rows - misses} of {counted_rows}")
    if args.write_error:
        if args.only:
            print("--write-error: the margin is measured over every row; drop --only", file=sys.stderr)
            return 2
        found = measured(records)
        write_measured_error(found)
        print(f"wrote {found}: planner.reserved_margin defaults to {found.margin:.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
