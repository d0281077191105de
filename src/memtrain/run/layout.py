"""Every name inside a run directory, in one place.

Why: the layout of a run (checkpoints, the run's JSON files, lineage, abandoned steps, metrics, the lock,
the export and profile folders, each logger's folder) used to be spelled in ten modules. Now a module
that needs a path inside a run asks a `RunLayout` (or a checkpoint's `CheckpointFiles`), and
`tests/test_architecture.py` fails when any module outside `memtrain.run` spells one of these names.

A checkpoint directory holds memtrain's own files (meta.json, each rank's RNG state, the fp16 grad
scaler) next to the files of the sharding backend that wrote it (`model.pt` / `optimizer.pt`, a DCP or
DeepSpeed folder): those belong to the backend's format and are named in
`memtrain.strategies.sharding`, which receives the checkpoint directory and nothing else of the run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory (nothing is created by asking)."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def recipe_file(self) -> Path:
        return self.root / "recipe.json"

    def recipe_backups(self) -> list[Path]:
        """recipe.<n>.json: the recipes a changed resume replaced, oldest first."""
        return sorted(self.root.glob("recipe.*.json"), key=lambda p: p.name)

    def recipe_backup(self, number: int) -> Path:
        return self.root / f"recipe.{number}.json"

    @property
    def plan_file(self) -> Path:
        return self.root / "plan.json"

    @property
    def summary_file(self) -> Path:
        return self.root / "summary.json"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def lineage_file(self) -> Path:
        return self.root / "lineage.jsonl"

    @property
    def lock_file(self) -> Path:
        return self.root / ".memtrain.lock"

    @property
    def abandoned(self) -> Path:
        """Where a truncation sets aside checkpoints and metrics rows (one folder per truncation)."""
        return self.root / "abandoned"

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer files the run trains with, copied when it starts: export copies these, never a
        path the run's recipe.json names."""
        return self.root / "tokenizer"

    @property
    def export_dir(self) -> Path:
        """`output.export: hf` writes the Hugging Face model here."""
        return self.root / "hf"

    @property
    def profile_dir(self) -> Path:
        """`memtrain profile` writes its reports here unless --out says elsewhere."""
        return self.root / "profile"

    def logger_dir(self, logger: str) -> Path:
        """A folder of the run that one logger owns (e.g. TensorBoard's event files)."""
        return self.root / logger

    def own_files(self) -> tuple[Path, ...]:
        """The files memtrain writes at the run's top level (each a regular file inside the run, or absent)."""
        return (
            self.recipe_file,
            self.plan_file,
            self.summary_file,
            self.metrics_file,
            self.lineage_file,
            self.lock_file,
        )

    def step_dirs(self) -> list[Path]:
        """Every `step_<8 digits>` name in checkpoints/, whatever it is (a directory, a symlink, a file)."""
        if not self.checkpoints.is_dir():
            return []
        return [child for child in self.checkpoints.iterdir() if STEP_DIR.match(child.name)]

    def own_folders(self) -> tuple[Path, ...]:
        """The folders memtrain manages in the run (checkpoints, what truncations set aside, the tokenizer)."""
        return (self.checkpoints, self.abandoned, self.tokenizer_dir)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass(frozen=True)
class CheckpointFiles:
    """memtrain's own files in one checkpoint directory (staging or committed)."""

    path: Path

    @property
    def meta(self) -> Path:
        return self.path / "meta.json"

    def rng(self, rank: int) -> Path:
        return self.path / f"rng_rank{rank}.pt"

    @property
    def grad_scaler(self) -> Path:
        return self.path / "grad_scaler.pt"
