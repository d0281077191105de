"""`memtrain plan --model ID|DIR --gpu PROFILE [--world-size N] [--seq-len L] [--lora|--qlora]
[--mode pretrain|sft|dpo] [--write-recipe FILE]`: a what-if without a recipe.

Why: the first question about a model is "does it fit on my GPUs, and how", asked before any recipe
exists. The recipe is built from defaults shaped like the shipped ones (recipes/llama3-8b-chat-sft.yaml,
-dpo-8xh100, -lora-8gpu, -qlora-24gb): bf16-mixed, checkpointing, sharding and micro-batches left to
the planner; it is planned as any recipe is, and `--write-recipe` keeps it, so the answer is one edit
(`data.path`) away from a run. The model is a local directory, a cached hub id, or a hub id memtrain has
a shape card for (`causal_lm.cards`): no download.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from memtrain.causal_lm.pretrained import resolve
from memtrain.errors import MemtrainError, RecipeError
from memtrain.recipe import apply_overrides

# mode -> the data section a user points at their own file. pretrain: the model's weights trained on
# text (from scratch, model.config holds its config.json instead of model.pretrained: the same plan).
DATA = {
    "pretrain": {"source": "text", "path": "data/corpus.txt", "kind": "text", "packing": True},
    "sft": {"source": "dataset", "path": "data/chat.jsonl", "kind": "chat", "packing": True},
    "dpo": {"source": "dataset", "path": "data/pairs.jsonl", "kind": "preference", "packing": False},
}
LEARNING_RATE = {"pretrain": 3.0e-4, "sft": 1.0e-5, "dpo": 5.0e-7}
ADAPTER_LEARNING_RATE = 2.0e-4
LORA = {"kind": "lora", "r": 16, "alpha": 32, "target_modules": "all-linear"}


@dataclass(frozen=True)
class WhatIf:
    """What the flags ask for."""

    model: str
    mode: str = "sft"
    adapters: str | None = None  # lora | qlora
    seq_len: int | None = None
    world_size: int = 1
    nodes: int | None = None

    @property
    def one_rank(self) -> bool:
        return self.nodes is None and self.world_size == 1

    def sequence_length(self) -> int:
        """--seq-len, else the shipped recipes' (2048 for DPO pairs and for QLoRA on one GPU, else 4096)."""
        if self.seq_len is not None:
            return self.seq_len
        return 2048 if self.mode == "dpo" or self.adapters == "qlora" else 4096


def check_flags(model: str | None, recipe: str | None, flags: dict[str, Any]) -> None:
    """`MemtrainError` naming the flag: --model and a recipe together, a what-if flag without --model, a
    --seq-len below 1."""
    given = [flag for flag, value in flags.items() if value not in (None, False)]
    if model is None:
        if recipe is None:
            raise MemtrainError("plan: give a recipe file, or --model ID|DIR for a what-if without one")
        if given:
            raise MemtrainError(f"{given[0]}: only with --model (a recipe says this itself)")
        return
    if recipe is not None:
        raise MemtrainError(f"--model: give a recipe ({recipe}) or --model, not both")
    seq_len = flags.get("--seq-len")
    if seq_len is not None and seq_len < 1:
        raise MemtrainError(f"--seq-len: must be at least 1 (it was {seq_len})")


def recipe(what: WhatIf) -> dict[str, Any]:
    """The recipe of `what`, as a mapping (shaped like the shipped fine-tuning recipes)."""
    model = _model_reference(what.model)
    adapted = what.adapters is not None
    name = Path(what.model).name.lower()
    model_section: dict[str, Any] = {"pretrained": model}
    if what.adapters == "qlora":
        model_section |= {"quantization": "nf4", "double_quant": True}
    data = {**DATA[what.mode], "tokenizer": model, "seq_len": what.sequence_length()}
    raw: dict[str, Any] = {
        "run": {"name": f"{name}-{what.adapters or what.mode}"},
        "model": model_section,
        "data": data,
        "batch": {"global_size": 16 if what.adapters == "qlora" else 64, "micro_size": "auto"},
        "train": {
            "steps": 1000,
            "lr": ADAPTER_LEARNING_RATE if adapted else LEARNING_RATE[what.mode],
            "warmup_steps": 30,
        },
        "checkpoint": {"every": 200, "keep": 2},
        "strategies": _strategies(what),
    }
    if adapted:
        raw["adapters"] = {**LORA, "dropout": 0.05} if what.adapters == "qlora" else dict(LORA)
    if what.mode == "dpo":
        raw["preference"] = {"beta": 0.1, "reference": "auto"}
    return raw


def _strategies(what: WhatIf) -> dict[str, Any]:
    """Precision pinned (numerics), the rest planned: adapters train in fp32 states beside a frozen base in
    the compute dtype (on one rank unsharded, as recipes/llama3-8b-qlora-24gb.yaml); full training may keep
    8-bit states."""
    sharding = "none" if what.one_rank else "auto"
    if what.adapters is not None:
        return {
            "precision": "bf16-mixed",
            "frozen_dtype": "compute",
            "checkpointing": "auto",
            "optimizer_states": "fp32",
            "sharding": sharding,
        }
    return {
        "precision": "bf16-mixed",
        "checkpointing": "auto",
        "optimizer_states": ["fp32", "8bit"],
        "sharding": "auto",
    }


def _model_reference(model: str) -> str:
    """--model as the recipe names it: a directory by its absolute path (the recipe may be written
    elsewhere), a hub id as given; `MemtrainError` naming --model when it is neither (resolving it says
    where its shapes come from: the cache, the hub, or memtrain's card)."""
    try:
        resolve(model, "--model", fetch_config=True)
    except RecipeError as exc:
        raise MemtrainError(exc.problems[0]) from None
    return str(Path(model).resolve()) if Path(model).is_dir() else model


def command_line(what: WhatIf, gpu: str | None, write_to: Path) -> str:
    """The `memtrain plan --model ...` command that asks for `what` (for the written recipe's header)."""
    parts = ["memtrain plan --model", what.model, "--mode", what.mode]
    parts += [f"--{what.adapters}"] if what.adapters else []
    parts += ["--seq-len", str(what.seq_len)] if what.seq_len is not None else []
    parts += ["--gpu", gpu] if gpu is not None else []
    parts += ["--world-size", str(what.world_size)] if what.world_size > 1 else []
    parts += ["--nodes", str(what.nodes)] if what.nodes is not None else []
    return " ".join([*parts, "--write-recipe", str(write_to)])


def write(raw: dict[str, Any], path: Path, command: str) -> None:
    """The recipe as YAML at `path` (refused when the file exists: a what-if never overwrites a recipe),
    headed by the command that made it and the edit that makes it a run."""
    if path.exists():
        raise MemtrainError(f"--write-recipe: {path} exists; give a new file name")
    header = (
        f"# Written by `{command}`.\n"
        f"# Point data.path at your data ({raw['data']['kind']}), then:\n"
        f"#   memtrain train {path}\n"
    )
    try:
        path.write_text(header + yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    except OSError as exc:
        raise MemtrainError(f"--write-recipe: cannot write {path} ({exc.strerror})") from None


def plan(what: WhatIf, overrides: list[str], write_to: Path | None, **target: Any) -> int:
    """Build `what`'s recipe with the `overrides` (key=value, as with a recipe file), write it (to
    `write_to`, else a temporary file) and plan it as `memtrain plan RECIPE` would, for the `target` flags
    (--gpu, --world-size, ...): the file written is the recipe planned."""
    from memtrain.commands import plan as plan_command

    raw = apply_overrides(recipe(what), overrides, "--model")
    with tempfile.TemporaryDirectory(prefix="memtrain-what-if-") as tmp:
        path = write_to if write_to is not None else Path(tmp) / "what-if.yaml"
        write(raw, path, command_line(what, target.get("gpu"), path))
        title = (
            str(write_to) if write_to is not None else f"--model {what.model} ({what.adapters or what.mode})"
        )
        return plan_command.run(str(path), [], name=title, **target)
