"""`memtrain train | validate | schema`.

Launch several ranks with torchrun: `torchrun --nproc_per_node=2 -m memtrain train RECIPE`. Every
user mistake (a `MemtrainError`) prints one message naming what to change and exits with code 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from memtrain.errors import MemtrainError

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memtrain", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a recipe (launch with torchrun for several ranks)")
    train.add_argument("recipe", help="path to a recipe YAML file")
    train.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.steps=20")
    train.add_argument("--resume", nargs="?", const=True, default=None, metavar="DIR|auto",
                       help="continue from the run's newest checkpoint, or from DIR; 'auto': resume if the "
                       "run has a checkpoint, else start fresh (for restarts under torchrun --max-restarts)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (same as output.progress=off)")

    validate = commands.add_parser("validate", help="check a recipe and its model config; print the result")
    validate.add_argument("recipe")
    validate.add_argument("overrides", nargs="*")

    commands.add_parser("schema", help="print the recipe JSON schema (for editor completion)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except MemtrainError as exc:
        rank = os.environ.get("RANK")
        prefix = f"memtrain (rank {rank}): error" if rank not in (None, "0") else "memtrain: error"
        print(f"{prefix}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    from memtrain.recipe import json_schema, load_recipe

    if args.command == "schema":
        print(json.dumps(json_schema(), indent=2))
        return 0
    overrides = list(args.overrides)
    if args.command == "train":
        if isinstance(args.resume, str) and "=" in args.resume and not os.path.exists(args.resume):
            overrides.insert(0, args.resume)  # `--resume train.steps=20`: the flag took an override
            args.resume = True
        if args.no_progress:
            overrides.append("output.progress=off")
    recipe = load_recipe(args.recipe, overrides)

    from memtrain.models import CausalLMTrainer, build_config, check_model_recipe

    if args.command == "validate":
        check_model_recipe(recipe)
        config = build_config(recipe)
        print(f"{args.recipe}: ok ({config.model_type}, {recipe.train.steps} steps, "
              f"global batch {recipe.batch.global_size} x {recipe.data.seq_len} tokens)")
        return 0

    from memtrain.distributed import shutdown
    from memtrain.trainer import describe_summary

    trainer = CausalLMTrainer(recipe)
    try:
        if trainer.env.is_main:
            print(f"[memtrain] plan: {json.dumps(trainer.plan.to_dict())}", flush=True)
        result = trainer.fit(resume=args.resume)
        if trainer.env.is_main:
            print(describe_summary(result.summary), flush=True)
    finally:
        shutdown(trainer.env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
