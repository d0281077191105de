"""`memtrain train | plan | profile | validate | export | schema`.

Launch several ranks with torchrun: `torchrun --nproc_per_node=2 -m memtrain train RECIPE`. Every
user mistake (a `MemtrainError`) prints one message naming what to change and exits with code 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from memtrain import json_out
from memtrain.errors import MemtrainError, TrainingStopped

EXIT_USAGE = 2  # a mistake in the input: the message names what to change
EXIT_STOPPED = 3  # the run stopped itself after a checkpoint (e.g. too many non-finite steps)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtrain",
        description=__doc__.splitlines()[0],
        epilog=_strategies(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a recipe (launch with torchrun for several ranks)")
    train.add_argument("recipe", help="path to a recipe YAML file")
    train.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.steps=20")
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="DIR|auto",
        help="continue from the run's newest checkpoint, or from DIR; 'auto': resume if the "
        "run has a checkpoint, else start fresh (for restarts under torchrun --max-restarts)",
    )
    train.add_argument(
        "--no-progress", action="store_true", help="no progress bar (same as output.progress=off)"
    )

    validate = commands.add_parser("validate", help="check a recipe and its model config; print the result")
    validate.add_argument("recipe")
    validate.add_argument("overrides", nargs="*")

    profile = commands.add_parser("profile", help="train a few steps under the memory tracker; write reports")
    profile.add_argument("recipe")
    profile.add_argument("overrides", nargs="*")
    profile.add_argument("--steps", type=int, default=3, help="steps to profile (default 3)")
    profile.add_argument(
        "--out", type=Path, default=None, help="output directory (default <run dir>/profile)"
    )
    profile.add_argument(
        "--json", action="store_true", help="print memory.json to stdout instead of the table"
    )

    plan = commands.add_parser("plan", help="predict every allowed plan's memory; show the fastest that fits")
    plan.add_argument("recipe")
    plan.add_argument("overrides", nargs="*")
    plan.add_argument("--json", action="store_true", help="print the plan, predictions and budget as JSON")
    plan.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help="plan for a GPU that is not here: a profile in configs/ (e.g. h100-80gb) or its path",
    )
    plan.add_argument(
        "--gpu-memory", default=None, metavar="SIZE", help="plan for a GPU of this size (e.g. 24GiB)"
    )
    plan.add_argument(
        "--world-size", type=int, default=None, metavar="N", help="ranks to plan for (default 1)"
    )

    export = commands.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face model directory (from_pretrained loads it)"
    )
    export.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run directory (holds recipe.json)")
    export.add_argument(
        "--step", type=int, default=None, metavar="N", help="the checkpoint's step (default: the newest)"
    )
    export.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="new or empty output directory"
    )
    export.add_argument(
        "--adapters-only",
        action="store_true",
        help="a LoRA run's adapters alone, in peft's format (PeftModel.from_pretrained loads them); "
        "default: merged into the base model",
    )

    commands.add_parser("schema", help="print the recipe JSON schema (for editor completion)")
    for command in (train, validate, profile, plan):
        command.add_argument(
            "--trainer",
            default=None,
            metavar="FILE.py:CLASS",
            help="your Trainer subclass (path/to/file.py:MyTrainer or package.module:MyTrainer); "
            "default: the built-in causal-LM trainer",
        )
    return parser


def _strategies() -> str:
    """The registered strategy names by recipe key (the registries are the one vocabulary)."""
    from memtrain.strategies.catalog import RECIPE_KINDS, REGISTRIES

    lines = [f"  {kind}: {', '.join(REGISTRIES[kind].names())}" for kind in RECIPE_KINDS]
    lines += [
        f"  adapters.kind: {', '.join(REGISTRIES['adapters'].names())}",
        f"  model.quantization: {', '.join(REGISTRIES['quantization'].names())}",
    ]
    return "strategies (recipe key strategies.<kind>: auto, a name, or a list of names):\n" + "\n".join(lines)


# Libraries that log about optional native kernels this run does not use (torchao's CUDA/Triton
# extensions on a CPU build, torch's pytree deprecations): errors still show.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        return _run(args)
    except MemtrainError as exc:
        rank = os.environ.get("RANK")
        prefix = f"memtrain (rank {rank}): error" if rank not in (None, "0") else "memtrain: error"
        print(f"{prefix}: {exc}", file=sys.stderr)
        return EXIT_STOPPED if isinstance(exc, TrainingStopped) else EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    from memtrain.recipe import json_schema, load_recipe

    if args.command == "schema":
        print(json.dumps(json_schema(), indent=2))
        return 0
    if args.command == "profile":
        return _profile(args)
    if args.command == "export":
        from memtrain.commands import export

        return export.run(args.run_dir, args.out, args.step, adapters_only=args.adapters_only)
    if args.command == "plan":
        from memtrain.commands import plan

        return plan.run(
            args.recipe,
            list(args.overrides),
            trainer=args.trainer,
            as_json=args.json,
            gpu=args.gpu,
            gpu_memory=args.gpu_memory,
            world_size=args.world_size,
        )
    overrides = list(args.overrides)
    if args.command == "train":
        if isinstance(args.resume, str) and "=" in args.resume and not os.path.exists(args.resume):
            overrides.insert(0, args.resume)  # `--resume train.steps=20`: the flag took an override
            args.resume = True
        if args.no_progress:
            overrides.append("output.progress=off")
    recipe = load_recipe(args.recipe, overrides)

    from memtrain.commands.trainers import trainer_class
    from memtrain.distributed import shutdown
    from memtrain.training.trainer import describe_summary

    if args.command == "validate":
        if args.trainer is None:
            from memtrain.causal_lm.trainer import build_config, check_model_recipe

            check_model_recipe(recipe)
            model = build_config(recipe).model_type
        else:
            validated = trainer_class(args.trainer)(recipe)
            model = validated.describe_model()
            shutdown(validated.env)
        print(
            f"{args.recipe}: ok ({model}, {recipe.train.steps} steps, global batch {recipe.batch.global_size})"
        )
        return 0

    if recipe.output.export == "hf":  # before training: a run that cannot be exported fails now
        from memtrain.causal_lm.export import model_config

        model_config(recipe)
    trainer = trainer_class(args.trainer)(recipe)
    try:
        trainer.setup()
        if trainer.env.is_main:
            print(f"[memtrain] plan: {trainer.plan.describe()}", flush=True)
        result = trainer.fit(resume=args.resume)
        if trainer.env.is_main:
            print(describe_summary(result.summary), flush=True)
    finally:
        shutdown(trainer.env)
    if recipe.output.export == "hf" and trainer.env.is_main and not result.preempted:
        _export_run(trainer.run_dir, result.steps_done)
    return 0


def _export_run(run_dir: Path, step: int) -> None:
    """`output.export: hf`: the final checkpoint as run_dir/hf (after `fit`'s closing barrier, in one
    process: the other ranks have saved and may already have left)."""
    from memtrain.causal_lm.export import HF_DIR, export_hf
    from memtrain.checkpoint import list_checkpoints

    if not any(c.step == step for c in list_checkpoints(run_dir / "checkpoints")):
        print(
            f"[memtrain] output.export: no checkpoint at the final step {step}, nothing exported; set "
            "checkpoint.at_end: true",
            file=sys.stderr,
            flush=True,
        )
        return
    written = export_hf(run_dir, run_dir / HF_DIR, step, overwrite=True)
    print(f"[memtrain] exported step {step} to {written} (Hugging Face format)", flush=True)


def _profile(args: argparse.Namespace) -> int:
    from memtrain.commands.profile import describe, run_profile

    if args.steps < 1:
        raise MemtrainError("--steps: must be at least 1")
    report, out_dir = run_profile(
        args.recipe, list(args.overrides) + ["output.progress=off"], args.steps, args.out, args.trainer
    )
    if os.environ.get("RANK", "0") == "0":
        print(json_out.dumps(report, indent=2) if args.json else describe(report, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
