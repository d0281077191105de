"""`RunDirectory`: one run's directory as an object: its lock, startup recovery, checkpoint lifecycle,
lineage and JSON files.

Why one object: the loop (`memtrain.training.trainer`) needs a handful of verbs — lock the run, start it
fresh or resume it, save a checkpoint, record the plan and the summary — and none of the rules behind
them (staging and atomic replace, pruning, truncating or forking a lineage, agreeing across ranks on a
full disk or on a checkpoint one rank cannot read). Those rules live in this package (`checkpoints`,
`lineage`, `lock`, `metrics_rows`); every path comes from `layout`. Export and the CLI read runs through
the same object, so no module outside `memtrain.run` spells a file name inside a run directory.

Every rank holds a `RunDirectory`; rank 0 alone writes the run's files and meta.json, each rank writes its
own files into a checkpoint being saved. The methods that agree across ranks are collectives: every rank
calls them together.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from memtrain import json_out
from memtrain.checkpoint import CheckpointError
from memtrain.distributed import DistEnv, any_rank, barrier, one_process
from memtrain.errors import MemtrainError
from memtrain.jsonfile import FileRefused, parse_json, read_regular_file
from memtrain.run import checkpoints as ckpt
from memtrain.run import confine, lineage, lock
from memtrain.run.layout import CheckpointFiles, RunLayout

MAX_TOKENIZER_FILE_BYTES = 2**30  # a tokenizer file the export copies (the largest real ones: ~35 MB)
Resume = str | Path | bool | None
"""`fit(resume=...)`: None/False (a fresh run), True (the run's newest checkpoint), "auto" (the newest if
there is one), or a checkpoint directory / a directory of them."""


class RunDirectory:
    """The run at `path`, as seen by this rank of `env` (one process when None)."""

    def __init__(self, path: Path, env: DistEnv | None = None) -> None:
        self.path = path
        self.layout = RunLayout(path)
        self.env = env or one_process()
        self.segment: lineage.Segment | None = None  # rank 0: the lineage this start continues
        self.tokenizer_files: dict[str, Path] = {}  # what `keep_tokenizer` copies in at each start

    # ------------------------------------------------------------------------------------ reading

    def checkpoints(self) -> list[ckpt.Checkpoint]:
        """This run's checkpoints, oldest first."""
        return ckpt.list_checkpoints(self.layout.checkpoints)

    def checkpoint_at(self, step: int | None) -> ckpt.Checkpoint:
        """Checkpoint `step` of the run, or its newest; errors name the flag to change."""
        found = self.checkpoints()
        if not found:
            raise MemtrainError(
                f"RUN_DIR: no checkpoint under {self.layout.checkpoints}; train with checkpoint.at_end: true "
                "(or checkpoint.every)"
            )
        if step is None:
            return found[-1]
        for candidate in found:
            if candidate.step == step:
                return candidate
        steps = ", ".join(str(c.step) for c in found)
        raise MemtrainError(
            f"--step: no checkpoint at step {step} in {self.layout.checkpoints} (it has steps {steps})"
        )

    def read_recipe(self) -> dict[str, Any]:
        """The run's resolved recipe (recipe.json, written by rank 0 when the run started), as a mapping."""
        file = self.layout.recipe_file
        if not os.path.lexists(file):
            raise MemtrainError(f"RUN_DIR: {self.path} holds no recipe.json (not a memtrain run directory)")
        try:  # inside the run, a regular file, bounded, never blocking (`jsonfile.read_regular_file`)
            raw = parse_json(read_regular_file(confine.confined(self.path, file), lineage.MAX_RECIPE_BYTES))
        except (OSError, FileRefused) as exc:
            raise MemtrainError(f"{file}: unreadable ({exc})") from None
        if not isinstance(raw, dict):
            raise MemtrainError(f"{file}: must hold a JSON object")
        return raw

    def kept_tokenizer_files(self, names: tuple[str, ...]) -> dict[str, bytes] | None:
        """The files of `names` in the run's tokenizer folder (regular files inside the run, bounded), or
        None when the run has no such folder (one trained before memtrain kept its tokenizer)."""
        folder = self.layout.tokenizer_dir
        if not os.path.lexists(folder):
            return None
        real = confine.confined(self.path, folder)
        kept = {}
        for name in names:
            try:
                kept[name] = read_regular_file(real / name, MAX_TOKENIZER_FILE_BYTES)
            except FileNotFoundError:
                continue
            except FileRefused as exc:
                raise MemtrainError(f"{folder / name}: not copied into the export ({exc})") from None
        return kept

    # ------------------------------------------------------------------------------------ starting

    def keep_tokenizer(self, files: dict[str, Path]) -> None:
        """The tokenizer files (name -> the user's file) copied into the run's tokenizer folder whenever a
        run starts here (rank 0, under the lock), so that `export` copies them from the run."""
        self.tokenizer_files = dict(files)

    def _write_tokenizer(self) -> None:
        """Rank 0: the tokenizer folder, replaced whole by the files `keep_tokenizer` named (a new folder
        renamed into place; the old one deleted after, never followed through a symlink)."""
        if not self.tokenizer_files:
            return
        folder = self.layout.tokenizer_dir
        fresh = Path(tempfile.mkdtemp(prefix=".tokenizer.", suffix=".tmp", dir=self.path))
        try:
            for name, source in self.tokenizer_files.items():
                shutil.copyfile(source, fresh / name)
            old = Path(tempfile.mkdtemp(prefix=".tokenizer.", suffix=".old.tmp", dir=self.path))
            if os.path.lexists(folder):
                os.replace(folder, old)
            os.replace(fresh, folder)
            confine.remove_tree(old)
        except OSError as exc:
            confine.remove_tree(fresh)
            raise json_out.write_error(folder, exc) from None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Rank 0 holds the run's lock (`memtrain.run.lock`) while the body runs, then recovers what a
        crash left (`recover`); the ranks agree on whether it got the lock and whether the run's own
        paths stay inside it (`confine.check_run_paths`), so every rank stops with the same error and none
        waits in a collective."""
        held: lock.RunLock | None = None
        in_use: lock.RunDirInUse | None = None
        damaged: MemtrainError | None = None
        if self.env.is_main:
            try:
                held = lock.acquire(self.path)
                confine.check_run_paths(self.layout)  # before anything is written, moved or cleaned
                confine.unshare_own_files(self.layout)  # appends never reach another run's hard links
            except lock.RunDirInUse as exc:
                in_use = exc
            except MemtrainError as exc:
                damaged = exc
        if any_rank(in_use is not None, self.env):
            raise in_use or lock.in_use_error(self.path)
        if any_rank(damaged is not None, self.env):
            if held is not None:
                held.release()
            raise damaged or MemtrainError(f"run.output_dir: rank 0 cannot use {self.path} (see its error)")
        try:
            self._recover()
            yield
        finally:
            if held is not None:
                held.release()

    def _recover(self) -> None:
        """Rank 0, under the lock, before any rank lists checkpoints: put back a checkpoint a crash left
        renamed aside, remove stale staging directories, finish a truncation a crash interrupted."""
        problem: MemtrainError | None = None
        if self.env.is_main:
            try:
                ckpt.recover(self.layout.checkpoints)
                lineage.finish_truncation(self.path)
            except MemtrainError as exc:  # a damaged lineage.jsonl, a record pointing outside the run
                problem = exc
        if any_rank(problem is not None, self.env):  # (also the barrier: nobody lists checkpoints before)
            raise problem or MemtrainError(
                f"run.output_dir: rank 0 cannot recover {self.path} (see its error)"
            )

    def wants_resume(self, resume: Resume) -> str | Path | bool:
        """`resume` with "auto" decided: True when the run holds a checkpoint, else False."""
        if resume == "auto":
            return bool(self.checkpoints())
        return resume if resume else False

    def start_fresh(self, recipe: dict[str, Any], plan_record: dict[str, Any]) -> None:
        """A new run here (it must hold no checkpoint): recipe.json, plan.json and the lineage's start."""
        existing = self.checkpoints()
        if existing:
            raise CheckpointError(
                f"{self.path} already holds checkpoints (newest: step {existing[-1].step}); "
                "pass --resume to continue it, or set run.output_dir to a new directory"
            )
        if self.env.is_main:
            self.segment = lineage.Segment(lineage.new_lineage_id(), None)
            self._write_run_files(recipe, plan_record)
            self._write_tokenizer()
            start = {"event": "start", "lineage": self.segment.lineage, "parent": None}
            lineage.append_record(self.path, {**start, "recipe": recipe})
        barrier(self.env)

    def restore(
        self,
        resume: str | Path | bool,
        load: Callable[[ckpt.Checkpoint], None],
        run_files: tuple[dict[str, Any], dict[str, Any]],
        fallback: bool,
    ) -> ckpt.Checkpoint:
        """Find the checkpoint to resume from and `load` it on every rank; with `fallback`, an unreadable
        newest checkpoint falls back to the previous one (the error names each file that failed). The
        ranks agree on each candidate, so a file only one rank reads (its RNG state) moves them all to the
        same checkpoint. Then the run's lineage goes on from the checkpoint loaded. `run_files` are the
        (recipe, plan record) a fork writes."""
        location = self.layout.checkpoints if resume is True else Path(str(resume))
        found = ckpt.find_checkpoint(location)
        event = self._resume_event(found)
        candidates = [found]
        if fallback and found.path.parent == location:
            candidates += [c for c in reversed(ckpt.list_checkpoints(location)) if c.step < found.step]
        for index, candidate in enumerate(candidates):
            try:
                load(candidate)
                problem = None
            except CheckpointError as exc:
                problem = str(exc)
            if not any_rank(problem is not None, self.env):
                self._continue_lineage(event, candidate, *run_files)
                return candidate
            problem = problem or f"{candidate.path}: another rank could not load it (see its error)"
            if index + 1 == len(candidates):
                raise CheckpointError(problem)
            if self.env.is_main:
                print(f"[memtrain] {problem}; falling back to {candidates[index + 1].path}", flush=True)
        raise AssertionError("unreachable")

    def check_resumable(
        self, found: ckpt.Checkpoint, recipe: dict[str, Any], total_steps: int, allow_recipe_change: bool
    ) -> dict[str, Any]:
        """`found`'s meta.json, once it is known to fit this run: the same model section, not past the
        run's end, and a recipe that changes the training only with `allow_recipe_change`
        (`lineage.check_recipe`)."""
        meta = found.meta
        saved = {"model": meta.get("model_section")}
        if lineage.recipe_changes(
            saved, {"model": recipe["model"]}
        ):  # a key newer than it, at its default: same
            raise CheckpointError(
                f"{found.files.meta}: saved for a different model section; resume with the same "
                "model: settings or start a new run.output_dir"
            )
        if found.step > total_steps:
            raise CheckpointError(f"{found.path}: is at step {found.step}, past train.steps={total_steps}")
        if not allow_recipe_change:
            unfinished = lineage.unfinished_segment(self.path, found, meta)
            lineage.check_recipe(found, meta, recipe, unfinished["recipe"] if unfinished else None)
        return meta

    def _resume_event(self, found: ckpt.Checkpoint) -> str:
        """'resume' from this run's newest checkpoint, 'truncate' from an older one of this run, 'fork'
        from another run's (this run must hold no checkpoint then)."""
        own = self.checkpoints()
        if found.path.parent.resolve() == self.layout.checkpoints.resolve():
            return "truncate" if found.step < own[-1].step else "resume"
        if own:
            raise CheckpointError(
                f"{found.path} belongs to another run: resuming from it forks that run into run.output_dir "
                f"{self.path}, which already holds checkpoints (newest: step {own[-1].step}); set "
                "run.output_dir to a new directory, or resume from a checkpoint of this run"
            )
        return "fork"

    def _continue_lineage(
        self, event: str, loaded: ckpt.Checkpoint, recipe: dict[str, Any], plan_record: dict[str, Any]
    ) -> None:
        """Rank 0 (which alone writes meta.json): start this segment of the run's lineage from the
        checkpoint just loaded, and record it. Its lineage id is a new one unless it resumes the newest
        checkpoint's, or continues a segment that started from the same checkpoint and died before saving."""
        if not self.env.is_main:
            return
        meta = loaded.meta
        unfinished = lineage.unfinished_segment(self.path, loaded, meta) if event != "truncate" else None
        if unfinished is not None:
            lineage_id = str(unfinished["lineage"])
        elif event == "resume" and meta.get("lineage"):
            lineage_id = str(meta["lineage"])
        else:
            lineage_id = lineage.new_lineage_id()
        self.segment = lineage.Segment(lineage_id, lineage.parent_of(loaded, meta))
        if event == "fork":
            self._write_run_files(recipe, plan_record)
        self._write_tokenizer()
        lineage.record_segment(self.path, event, self.segment, loaded, recipe, unfinished)

    def _write_run_files(self, recipe: dict[str, Any], plan_record: dict[str, Any]) -> None:
        """recipe.json and plan.json of a run that starts here (fresh, or forked from another run)."""
        self.path.mkdir(parents=True, exist_ok=True)
        json_out.write_atomic(self.layout.recipe_file, recipe)
        self.write_plan(plan_record)

    # ------------------------------------------------------------------------------------ saving

    def save_checkpoint(
        self, step: int, write: Callable[[CheckpointFiles], None], meta: dict[str, Any], keep: int
    ) -> Path:
        """Atomically save checkpoint `step`: every rank's `write` fills the staging directory, then rank 0
        writes meta.json (`meta` plus the step, lineage and time) and renames it into place, pruning to
        the newest `keep`. A full disk (or quota) on any rank is the same one-line `DiskFullError` on
        every rank: the staging directory is removed and the previous checkpoint stays."""
        root = self.layout.checkpoints
        staging = ckpt.staging_dir(root, step)
        if self.env.is_main:
            ckpt.begin_save(root, step)
        barrier(self.env)
        self._save_agreed(step, lambda: write(CheckpointFiles(staging)))
        self._save_agreed(step, lambda: self._commit(step, meta, keep) if self.env.is_main else None)
        return root / ckpt.step_dir_name(step)

    def _commit(self, step: int, meta: dict[str, Any], keep: int) -> None:
        """Rank 0: meta.json last, then the rename into place and the pruning (`checkpoints.commit_save`)."""
        segment = self.segment
        full = {
            **meta,
            "step": step,
            "lineage": segment.lineage if segment is not None else None,
            "parent": segment.parent if segment is not None else None,
            "saved_at": time.time(),
        }
        ckpt.commit_save(self.layout.checkpoints, step, full, keep)

    def _save_agreed(self, step: int, write: Callable[[], None]) -> None:
        """Run one part of a save, then agree with the other ranks (this is the save's barrier), so that a
        full disk on one rank stops every rank with the same error instead of leaving them waiting."""
        full = False
        try:
            write()
        except Exception as exc:
            if not ckpt.is_disk_full(exc):
                raise
            full = True
        if any_rank(full, self.env):
            if self.env.is_main:
                ckpt.abort_save(self.layout.checkpoints, step)
            raise ckpt.disk_full_error(self.layout.checkpoints, step) from None

    # ------------------------------------------------------------------------------------ the run's files

    def write_plan(self, record: dict[str, Any]) -> None:
        """plan.json: the plan, its prediction and budget, and what the run measured against them."""
        json_out.write_atomic(self.layout.plan_file, record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        json_out.write_atomic(self.layout.summary_file, summary)
