"""`memtrain train | plan | profile | validate | export | schema`.

Launch several ranks with torchrun: `torchrun --nproc_per_node=2 -m memtrain train RECIPE`. Every
user mistake (a `MemtrainError`) prints one message naming what to change and exits with code 2,
without a traceback. Ctrl-C exits 130 without one: during training after a checkpoint of the step in
flight (see `training.preemption`), before it at the next safe point (between the planner's traces, at
the end of setup), in one line. A stop signal (`train.stop_signals`: SIGTERM, SIGHUP, SIGUSR1, SIGQUIT
by default) exits 0 the same way, a pre-emption being a normal end. key=value overrides may come before
or after the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import memtrain
from memtrain import json_out
from memtrain.errors import MemtrainError, TrainingStopped
from memtrain.training import preemption
from memtrain.training.preemption import EXIT_INTERRUPTED, SignalStop

EXIT_USAGE = 2  # a mistake in the input: the message names what to change
EXIT_STOPPED = 3  # the run stopped itself after a checkpoint (e.g. too many non-finite steps)
# and EXIT_INTERRUPTED, 130: Ctrl-C. A run stopped by a stop signal (SIGTERM, ...) exits 0 (a preemption).


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtrain",
        description=__doc__.splitlines()[0],
        epilog=_strategies(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"memtrain {memtrain.__version__}")
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
    train.add_argument(
        "--allow-recipe-change",
        action="store_true",
        help="resume even though the recipe changes the training (e.g. train.lr); the change is "
        "recorded in the run's lineage.jsonl",
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
    plan.add_argument("recipe", nargs="?", help="a recipe YAML file (or --model for a what-if without one)")
    plan.add_argument("overrides", nargs="*")
    _what_if_flags(plan)
    plan.add_argument("--json", action="store_true", help="print the plan, predictions and budget as JSON")
    plan.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help="plan for a GPU that is not here: a profile in configs/ (e.g. h100-80gb) or its path",
    )
    plan.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="plan for a GPU of this size (e.g. 24GiB, 80GB; a bare number is GiB)",
    )
    plan.add_argument(
        "--host-memory",
        default=None,
        metavar="SIZE",
        help="host memory per GPU that offloaded states may use, with --gpu/--gpu-memory "
        "(default: the profile's host_memory_bytes, else 64GiB)",
    )
    plan.add_argument(
        "--world-size", type=int, default=None, metavar="N", help="ranks to plan for (default 1)"
    )
    plan.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="nodes to plan for (ranks: nodes x GPUs per node)",
    )
    plan.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help="GPUs per node (default: the --gpu profile's gpus_per_node, else 8)",
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

    schema = commands.add_parser("schema", help="print the recipe JSON schema (for editor completion)")
    for command in (train, validate, profile, plan, schema):
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


def _parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, but key=value overrides may also follow a flag (`train R --no-progress
    train.steps=1`). argparse fills the overrides list from the first run of positionals only, so
    later ones arrive as unrecognised arguments; parse_intermixed_args would fix that but does not
    support subcommands."""
    args, extras = parser.parse_known_args(argv)
    late = [a for a in extras if "=" in a and not a.startswith("-")] if hasattr(args, "overrides") else []
    unknown = [a for a in extras if a not in late]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


# Library log lines that are not for the user of a command (errors still show): torchao's notes on
# CUDA/Triton extensions a CPU build lacks, torch's pytree deprecations, bitsandbytes' notes on
# optional CPU kernels (peft imports it for LoRA), and DeepSpeed's accelerator detection, which it
# writes to stdout when imported (by an export or the DeepSpeed backend).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends", "DeepSpeed")


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def _quiet_libraries() -> None:
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)  # for the logger's children
        logger.addFilter(_errors_only)  # for itself: DeepSpeed resets its level when imported


def _who() -> str:
    rank = os.environ.get("RANK")
    return f"memtrain (rank {rank})" if rank not in (None, "0") else "memtrain"


def _say(line: str) -> None:
    """One line to stderr in one write: the ranks of a job share a pipe, and `print` writes the text and
    its newline separately, so two ranks' errors could run into one line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Ctrl-C inside the block raises KeyboardInterrupt when it ends, not where it landed: torch's import
    runs C++ (pybind11) code that aborts the process (SIGABRT, "terminate called after throwing ...
    KeyboardInterrupt") if the interrupt surfaces inside it. A shell's background job, which ignores
    SIGINT, keeps ignoring it."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    if caught:
        raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with _ctrl_c_deferred():
            import torch  # noqa: F401  (seconds; the registries of `_parse_args` need it)
        args = _parse_args(_parser(), argv)
        _quiet_libraries()
        return _run(args)
    except MemtrainError as exc:
        _say(f"{_who()}: error: {exc}")
        return EXIT_STOPPED if isinstance(exc, TrainingStopped) else EXIT_USAGE
    except SignalStop as exc:  # a stop signal with no step in flight: nothing to checkpoint
        _say(f"{_who()}: {exc}")
        return 0
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (in it: training.preemption)
        _say(f"{_who()}: interrupted")
        return EXIT_INTERRUPTED


def _what_if_flags(plan: argparse.ArgumentParser) -> None:
    """`memtrain plan --model ...`: a what-if without a recipe (`commands.what_if`)."""
    plan.add_argument(
        "--model",
        default=None,
        metavar="ID|DIR",
        help="plan this model without a recipe: a model directory, a hub id in the cache, or one memtrain "
        "has a shape card for (e.g. meta-llama/Llama-3.1-8B); the recipe is built from defaults",
    )
    plan.add_argument(
        "--mode",
        choices=("pretrain", "sft", "dpo"),
        default=None,
        help="with --model: what to train (default sft)",
    )
    adapters = plan.add_mutually_exclusive_group()
    adapters.add_argument("--lora", action="store_true", help="with --model: LoRA adapters on a frozen base")
    adapters.add_argument("--qlora", action="store_true", help="with --model: LoRA on a 4-bit (nf4) base")
    plan.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="L",
        help="with --model: tokens per row (default 4096; 2048 for dpo, qlora)",
    )
    plan.add_argument(
        "--write-recipe",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --model: write the recipe it planned",
    )


def _plan(args: argparse.Namespace) -> int:
    from memtrain.commands import plan, what_if

    target = {
        "trainer": args.trainer,
        "as_json": args.json,
        "gpu": args.gpu,
        "gpu_memory": args.gpu_memory,
        "world_size": args.world_size,
        "host_memory": args.host_memory,
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
    }
    overrides, recipe = list(args.overrides), args.recipe
    if args.model is not None and recipe is not None and "=" in recipe:  # an override, not a recipe
        overrides, recipe = [recipe, *overrides], None
    flags = {
        "--mode": args.mode,
        "--lora": args.lora,
        "--qlora": args.qlora,
        "--seq-len": args.seq_len,
        "--write-recipe": args.write_recipe,
    }
    what_if.check_flags(args.model, recipe, flags)
    if args.model is None:
        assert recipe is not None
        return plan.run(recipe, overrides, **target)
    what = what_if.WhatIf(
        model=args.model,
        mode=args.mode or "sft",
        adapters="qlora" if args.qlora else "lora" if args.lora else None,
        seq_len=args.seq_len,
        world_size=args.world_size or 1,
        nodes=args.nodes,
    )
    return what_if.plan(what, overrides, args.write_recipe, **target)


def _run(args: argparse.Namespace) -> int:
    if args.command == "schema":
        from memtrain.commands.trainers import recipe_schema

        print(json.dumps(recipe_schema(args.trainer), indent=2))
        return 0
    if args.command == "profile":
        return _profile(args)
    if args.command == "export":
        from memtrain.commands import export

        return export.run(args.run_dir, args.out, args.step, adapters_only=args.adapters_only)
    if args.command == "plan":
        return _plan(args)
    overrides = list(args.overrides)
    if args.command == "train":
        if isinstance(args.resume, str) and "=" in args.resume and not os.path.exists(args.resume):
            overrides.insert(0, args.resume)  # `--resume train.steps=20`: the flag took an override
            args.resume = True
        if args.no_progress:
            overrides.append("output.progress=off")
    from memtrain.commands.trainers import for_recipe, load_checked_recipe, no_exit_from_hooks, trainer_class

    with _ctrl_c_deferred():  # imports of the trainer's module and its libraries: C++ code too
        trainer_cls = trainer_class(args.trainer)
        recipe = load_checked_recipe(args.recipe, overrides, trainer_cls)
    from memtrain.training.results import describe_summary

    if args.command == "validate":
        from memtrain.commands.trainers import validate

        with no_exit_from_hooks():
            model = validate(recipe, args.recipe, trainer_cls)
        print(
            f"{args.recipe}: ok ({model}, {recipe.train.steps} steps, global batch {recipe.batch.global_size})"
        )
        return 0

    if recipe.output.export == "hf":  # before training: a run that cannot be exported fails now
        from memtrain.causal_lm.export import model_config

        model_config(recipe)
    with preemption.watching(recipe.train.stop_signals), no_exit_from_hooks():  # from before the group joins
        trainer = for_recipe(trainer_cls, recipe)(recipe)
        try:
            trainer.setup()
            if trainer.env.is_main:
                print(f"[memtrain] plan: {trainer.plan.describe()}", flush=True)
            result = trainer.fit(resume=args.resume, allow_recipe_change=args.allow_recipe_change)
            if trainer.env.is_main:
                print(describe_summary(result.summary), flush=True)
        finally:
            trainer.close()
    if recipe.output.export == "hf" and trainer.env.is_main and not result.preempted:
        _export_run(trainer.run_dir, result.steps_done)
    return EXIT_INTERRUPTED if result.stopped_by == "SIGINT" else 0


def _export_run(run_dir: Path, step: int) -> None:
    """`output.export: hf`: the final checkpoint into the run's export folder (after `fit`'s closing
    barrier, in one process: the other ranks have saved and may already have left)."""
    from memtrain.causal_lm.export import export_hf
    from memtrain.run import RunDirectory

    run = RunDirectory(run_dir)
    if not any(c.step == step for c in run.checkpoints()):
        print(
            f"[memtrain] output.export: no checkpoint at the final step {step}, nothing exported; set "
            "checkpoint.at_end: true",
            file=sys.stderr,
            flush=True,
        )
        return
    written = export_hf(run_dir, run.layout.export_dir, step, overwrite=True)
    print(f"[memtrain] exported step {step} to {written} (Hugging Face format)", flush=True)


def _profile(args: argparse.Namespace) -> int:
    from memtrain.commands.profile import describe, run_profile
    from memtrain.commands.trainers import no_exit_from_hooks

    if args.steps < 1:
        raise MemtrainError("--steps: must be at least 1")
    with no_exit_from_hooks():
        report, out_dir = run_profile(
            args.recipe, list(args.overrides) + ["output.progress=off"], args.steps, args.out, args.trainer
        )
    if os.environ.get("RANK", "0") == "0":
        print(json_out.dumps(report, indent=2) if args.json else describe(report, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
