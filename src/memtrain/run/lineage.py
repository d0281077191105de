"""Run lineage: which checkpoints, metrics rows and recipe the trajectory a run continues is made of.

Why: resuming from a checkpoint older than the run's newest (a rollback) left the newer checkpoints in
place, so after a crash the next `--resume` continued the *old* trajectory, from another learning rate,
with a gap in metrics.jsonl; and a resume with a changed recipe went unnoticed. Now every start of `fit`
is one *segment*, and the run directory says which trajectory each checkpoint belongs to.

- A *lineage* is one unbranched trajectory, named by a random id. Every checkpoint's meta.json holds its
  `lineage` and `parent`: the step, lineage and path of the checkpoint its segment resumed from (null
  for a fresh start), plus the resolved `recipe` it was trained with.
- `<run>/lineage.jsonl` gets one line per segment (`event`, `lineage`, `parent`, `recipe`,
  `recipe_changes`, ...), written with the strict-JSON writer. The events:
  - `start`: a fresh run, a new lineage.
  - `resume`: from this run's newest checkpoint; the lineage goes on under its id.
  - `truncate`: from an older checkpoint of this run. The newer checkpoints are renamed (nothing is
    deleted) into `<run>/abandoned/<time>-<lineage>/`, the metrics rows past the step follow into
    `metrics.jsonl` there, and a new lineage starts, so a later `--resume` continues the new lineage.
  - `fork`: from a checkpoint of another run directory. This run is set up like a fresh one (it must
    hold no checkpoint) and its lineage's parent is the other run's checkpoint.

Crash safety:
- A truncation is written to lineage.jsonl before anything moves; the next start finishes an unfinished
  one (`finish_truncation`), so a kill mid-truncation never lets the old trajectory come back.
- A segment that died before its first checkpoint is continued by the next start from the same
  checkpoint: its lineage id is kept, and the recipe it was allowed is allowed again.
- Metrics rows past the resumed step (a rollback's, or those a killed run logged after its last
  checkpoint) are moved to an abandoned file, never dropped.
- A fork that died before its first checkpoint leaves a run without checkpoints: `--resume auto` would
  start it fresh, so repeat the fork's own command instead.

Recipe changes on resume. A resume whose recipe differs from the checkpoint's in a key that changes
the trajectory is refused (`RecipeChanged`, naming the keys and `--allow-recipe-change`); with the flag
the change is recorded in lineage.jsonl, and recipe.json is rewritten (the old one kept as
recipe.<n>.json). These keys (`all_free_keys()`, with everything under them) may change freely:

- `train.steps`: extending a run is the point of a resume (the schedule's decay stretches to the new end);
- `run.name`, `run.output_dir`, `checkpoint.*`, `output.*`: where and how often things are written;
- `train.log_every`, `train.eval_every`, `train.eval_batches`: what is reported, not what is trained;
- `train.max_bad_steps`, `train.early_stopping`: when to stop, not how to step;
- `memory.*`, `planner.*`, `batch.micro_size`, `batch.micro_tokens`, and the strategy keys declared with
  `changes_trajectory=False` (`memtrain.strategies.catalog.free_keys`: sharding and its options,
  checkpointing, the loss, the optimizer step; the table in docs/STRATEGIES.md): the gradient is that of
  the global batch whatever the micro-batching (see `memtrain.training.trainer`), and sharding, when
  gradients are reduced, recomputation, a chunked cross-entropy or stepping each parameter in backward
  (the same update; its optimizer state has the standard layout) move bytes, not arithmetic (an
  out-of-memory error already tells users to resume with a smaller `batch.micro_size`).

Every other key (data, batch.global_size, the rest of train, precision, optimizer states, comm hook,
adapters, run.seed) changes the trajectory. `model.*` is never allowed to change: the weights would not
fit (a separate error). Keys the saved recipe lacks (a checkpoint of an older memtrain, which had no
saved recipe or fewer keys) are unknown and not compared, unless the new value differs from the
recipe's default.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtrain import json_out
from memtrain.errors import MemtrainError, shortened
from memtrain.jsonfile import MAX_JSON_DEPTH, FileRefused, json_depth, parse_json, read_regular_file
from memtrain.recipe import Recipe
from memtrain.run import checkpoints as ckpt
from memtrain.run.confine import RunPathError, confined, open_no_follow
from memtrain.run.layout import RunLayout
from memtrain.run.metrics_rows import abandon_rows_after
from memtrain.strategies.catalog import free_keys

RUN_FREE_KEYS = (
    "run.name",
    "run.output_dir",
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.max_bad_steps",
    "train.early_stopping",
    "train.stop_signals",
    "batch.micro_size",
    "batch.micro_tokens",
    "checkpoint",
    "output",
    "memory",
    "planner",
    "strategies.mesh",
    "strategies.moe.max_load",
)
"""The free keys outside the strategies; those of the strategies are declared with them (`all_free_keys`)."""


def all_free_keys() -> tuple[str, ...]:
    """Every key a resume may change freely: `RUN_FREE_KEYS` and the strategies' (registered now)."""
    return RUN_FREE_KEYS + free_keys()


FLAG = "--allow-recipe-change"
MAX_RECIPE_BYTES = 16 * 2**20  # a recipe.json larger than this is not one memtrain wrote
VALUE_CHARS = 40  # each value in an error, cut to this
ABSENT = "(absent)"


class RecipeChanged(MemtrainError):
    """A resume whose recipe changes the trajectory, without --allow-recipe-change."""


class LineageDamaged(MemtrainError):
    """lineage.jsonl holds something memtrain did not write (the message names the file and line)."""


LINEAGE_CHARS = 40  # of a lineage id in a folder name (memtrain's are 12 hex digits)
MAX_LINEAGE_BYTES = 64 * 2**20  # one line per start of a run, each a few kilobytes
LINEAGE_FIX = (
    "memtrain wrote this file, so something else changed it: restore it from a backup, or move it aside "
    "to go on without the run's history (an unfinished rollback it recorded is then not finished)"
)
RECORD_FIELDS: dict[str, tuple[str, Any]] = {  # field -> (what it must be, its check)
    "event": ("start, resume, truncate or fork", lambda v: v in ("start", "resume", "truncate", "fork")),
    "lineage": ("a string", lambda v: isinstance(v, str)),
    "parent": ("null or an object", lambda v: v is None or isinstance(v, dict)),
    "recipe": ("an object", lambda v: v is None or isinstance(v, dict)),
}


@dataclass(frozen=True)
class Segment:
    """What this start of `fit` continues: the lineage id its checkpoints get, and their parent."""

    lineage: str
    parent: dict[str, Any] | None  # {"step", "lineage", "path"} of the checkpoint resumed from


def new_lineage_id() -> str:
    return secrets.token_hex(6)


def parent_of(found: ckpt.Checkpoint, meta: dict[str, Any]) -> dict[str, Any]:
    return {"step": found.step, "lineage": meta.get("lineage"), "path": str(found.path.resolve())}


# ------------------------------------------------------------------------------------ recipe changes


def recipe_changes(saved: Any, current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (saved value, current value) for every leaf that differs; {} when nothing was saved."""
    if not isinstance(saved, dict):
        return {}
    old, new, defaults = _leaves(saved), _leaves(current), _leaves(Recipe().to_dict())
    changes = {}
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, ABSENT), new.get(key, ABSENT)
        if before == after or (before == ABSENT and defaults.get(key, ABSENT) == after):
            continue  # equal, or a key newer than the checkpoint at its default
        changes[key] = (before, after)
    return changes


def trajectory_changes(changes: dict[str, tuple[Any, Any]]) -> dict[str, tuple[Any, Any]]:
    """The changes outside `all_free_keys()` (see the module docstring)."""
    free = all_free_keys()
    return {
        key: change
        for key, change in changes.items()
        if not any(key == k or key.startswith(k + ".") for k in free)
    }


def check_recipe(
    found: ckpt.Checkpoint, meta: dict[str, Any], current: dict[str, Any], allowed: dict[str, Any] | None
) -> None:
    """`RecipeChanged` when `current` changes the trajectory of `found`'s saved recipe, unless it matches
    `allowed` (the recipe a segment that started from `found` and saved nothing was allowed)."""
    changed = trajectory_changes(recipe_changes(meta.get("recipe"), current))
    if not changed or (allowed is not None and not trajectory_changes(recipe_changes(allowed, current))):
        return
    raise RecipeChanged(
        f"{found.path}: the recipe differs from the checkpoint's in {describe_changes(changed)}, which "
        f"changes the training; resume with the checkpoint's values, or pass {FLAG} "
        "(Trainer.fit(allow_recipe_change=True)) to continue with the new ones (recorded in lineage.jsonl)"
    )


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} ({_short(old)} -> {_short(new)})" for key, (old, new) in changes.items())


def _short(value: Any) -> str:
    text = value if value == ABSENT else json.dumps(value)
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> value of every non-mapping leaf (an empty mapping has none)."""
    if not isinstance(value, dict):
        return {prefix: value}
    leaves: dict[str, Any] = {}
    for key, item in value.items():
        leaves.update(_leaves(item, f"{prefix}.{key}" if prefix else str(key)))
    return leaves


def save_recipe(run_dir: Path, recipe: dict[str, Any]) -> None:
    """Write recipe.json; a different one already there (or a damaged one) is kept as recipe.<n>.json."""
    layout = RunLayout(run_dir)
    path = layout.recipe_file
    if os.path.lexists(path):  # a regular file inside the run (`confine.check_run_paths`)
        try:
            same = parse_json(read_regular_file(path, MAX_RECIPE_BYTES)) == recipe
        except (OSError, FileRefused):  # damaged: kept as a backup like a changed one
            same = False
        if same:
            return
        os.replace(path, layout.recipe_backup(1 + len(layout.recipe_backups())))
    json_out.write_atomic(path, recipe)


# ------------------------------------------------------------------------------------ lineage.jsonl


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The segments recorded in lineage.jsonl, each checked (`LineageDamaged` naming the file and line
    otherwise). A last line cut by a crash (no newline yet) is left out: what it announced never began."""
    path = RunLayout(run_dir).lineage_file
    if not os.path.lexists(path):
        return []
    data = _read_lineage(path)
    complete = data[: data.rfind(b"\n") + 1]
    return [
        _check_record(run_dir, path, number, line) for number, line in enumerate(complete.splitlines(), 1)
    ]


def _read_lineage(path: Path) -> bytes:
    """The bytes of lineage.jsonl, read without following a symlink, bounded."""
    try:
        fd = open_no_follow(path, os.O_RDONLY)
    except OSError as exc:
        raise LineageDamaged(f"{path}: cannot be read ({exc.strerror or exc}); {LINEAGE_FIX}") from None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_LINEAGE_BYTES + 1)
    if len(data) > MAX_LINEAGE_BYTES:
        raise LineageDamaged(
            f"{path}: is over {MAX_LINEAGE_BYTES // 2**20} MiB, far more than memtrain writes; {LINEAGE_FIX}"
        )
    return data


def _check_record(run_dir: Path, path: Path, number: int, line: bytes) -> dict[str, Any]:
    """One line of lineage.jsonl as the record memtrain wrote, or `LineageDamaged` saying what is wrong."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested past the parser's limit
        raise LineageDamaged(
            f"{path}: line {number} is not a JSON record ({_first_line(exc)}); {LINEAGE_FIX}"
        ) from None
    problem = _record_problem(run_dir, record)
    if problem is not None:
        raise LineageDamaged(f"{path}: line {number} {problem}; {LINEAGE_FIX}")
    return dict(record)


def _record_problem(run_dir: Path, record: Any) -> str | None:
    """What makes `record` something memtrain did not write, or None."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}, not a record"
    if json_depth(record) > MAX_JSON_DEPTH:
        return f"is nested more than {MAX_JSON_DEPTH} levels deep"
    wrong = [
        f"{key} is not {kind}" for key, (kind, check) in RECORD_FIELDS.items() if not check(record.get(key))
    ]
    if record.get("event") == "truncate":
        steps = record.get("moved_steps")
        if not isinstance(steps, list) or not all(type(s) is int for s in steps):
            wrong.append("moved_steps is not a list of steps")
        if not isinstance(record.get("abandoned"), str) or not _inside_abandoned(
            run_dir, record["abandoned"]
        ):
            where = shortened(record.get("abandoned"))
            return (
                f"names {where} as its abandoned folder, which is not inside {RunLayout(run_dir).abandoned}"
            )
    return "is damaged (" + "; ".join(wrong) + ")" if wrong else None


def _inside_abandoned(run_dir: Path, relative: str) -> bool:
    """Whether `run_dir / relative` is a folder strictly inside the run's abandoned/ (symlinks resolved)."""
    folder = RunLayout(run_dir).abandoned
    try:
        real = confined(folder, run_dir / relative)
    except RunPathError:
        return False
    return real != Path(os.path.realpath(folder))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


def append_record(run_dir: Path, record: dict[str, Any]) -> None:
    """One segment's line, flushed to disk before anything it announces happens. A line a crash cut is
    cut off first (it announced nothing that happened); the file is never followed through a symlink."""
    record = {"time": _now().isoformat(timespec="seconds"), **record}
    path = RunLayout(run_dir).lineage_file
    line = (json_out.dumps(record, sort_keys=True) + "\n").encode()
    try:
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
        with os.fdopen(fd, "r+b") as handle:
            data = handle.read(MAX_LINEAGE_BYTES + 1)
            if len(data) + len(line) > MAX_LINEAGE_BYTES:  # never write what `read_records` refuses
                raise LineageDamaged(
                    f"{path}: this start's record would take it past {MAX_LINEAGE_BYTES // 2**20} MiB, the most "
                    "memtrain reads back; move it aside to go on without the run's history"
                )
            handle.truncate(data.rfind(b"\n") + 1)
            handle.seek(0, os.SEEK_END)
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise json_out.write_error(path, exc) from None


def unfinished_segment(run_dir: Path, found: ckpt.Checkpoint, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The last recorded segment when it started from `found` and no checkpoint of it exists: a start
    from `found` continues it (its lineage id and allowed recipe)."""
    records = read_records(run_dir)
    if not records or records[-1].get("parent") != parent_of(found, meta):
        return None
    last = records[-1]
    saved = any(
        c.step > found.step and _lineage_of(c) == last.get("lineage")
        for c in ckpt.list_checkpoints(RunLayout(run_dir).checkpoints)
    )
    return None if saved else last


def _lineage_of(found: ckpt.Checkpoint) -> Any:
    try:
        return found.meta.get("lineage")
    except ckpt.CheckpointError:
        return None


# ------------------------------------------------------------------------------------ truncation


def abandoned_dir(run_dir: Path, lineage: str | None) -> Path:
    """A new directory name under <run>/abandoned/ for what this start sets aside (made when used)."""
    stamp = _now().strftime("%Y%m%dT%H%M%S")
    name = re.sub(r"[^A-Za-z0-9_-]", "_", str(lineage or "unknown"))[:LINEAGE_CHARS]  # meta.json's, unchecked
    base = RunLayout(run_dir).abandoned / f"{stamp}-{name}"
    target, number = base, 1
    while target.exists():
        number += 1
        target = base.with_name(f"{base.name}-{number}")
    return target


def move_checkpoints(root: Path, steps: list[int], keep_lineage: str, target: Path) -> list[int]:
    """Rename the checkpoints of `steps` under `root` into `target`, except those of `keep_lineage` (the
    new lineage's own, when a truncation is finished late); returns the steps moved."""
    moved = []
    for found in reversed(ckpt.list_checkpoints(root)):
        if found.step in steps and _lineage_of(found) != keep_lineage:
            target.mkdir(parents=True, exist_ok=True)
            ckpt.move_dir(found.path, target / found.path.name)
            moved.append(found.step)
    return moved


def finish_truncation(run_dir: Path) -> list[int]:
    """Finish the last recorded truncation if a crash interrupted it; returns the steps moved now (into
    the folder its record names, which `read_records` checked is inside the run's abandoned/)."""
    records = read_records(run_dir)
    last = records[-1] if records else None
    if last is None or last.get("event") != "truncate":
        return []
    return move_checkpoints(
        RunLayout(run_dir).checkpoints,
        list(last.get("moved_steps", [])),
        str(last.get("lineage")),
        run_dir / str(last.get("abandoned")),
    )


def describe_steps(steps: list[int]) -> str:
    """[5, 6, 7, 9] -> '5-7, 9'."""
    ordered, parts = sorted(steps), []
    start = 0
    for index in range(1, len(ordered) + 1):
        if index == len(ordered) or ordered[index] != ordered[index - 1] + 1:
            first, last = ordered[start], ordered[index - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = index
    return ", ".join(parts)


def record_segment(
    run_dir: Path,
    event: str,
    segment: Segment,
    loaded: ckpt.Checkpoint,
    recipe: dict[str, Any],
    unfinished: dict[str, Any] | None,
) -> None:
    """Rank 0, once the checkpoint `loaded` is in: truncate the run (recorded in lineage.jsonl first, then
    moved) or record the resume or fork, set aside the metrics rows past the step, and rewrite a changed
    recipe.json. A fork's run files are the caller's to write first."""
    meta = loaded.meta
    changes = recipe_changes(meta.get("recipe"), recipe)
    if unfinished is not None and "abandoned" in unfinished:  # a truncation that died: same place
        abandoned = run_dir / str(unfinished["abandoned"])
    else:
        abandoned = abandoned_dir(run_dir, meta.get("lineage"))
    record: dict[str, Any] = {
        "event": event,
        "lineage": segment.lineage,
        "parent": segment.parent,
        "recipe_changes": {key: list(change) for key, change in changes.items()},
        "recipe": recipe,
    }
    if event == "truncate":
        root = loaded.path.parent
        newer = [c.step for c in ckpt.list_checkpoints(root) if c.step > loaded.step]
        where = str(abandoned.relative_to(run_dir))
        append_record(run_dir, {**record, "moved_steps": newer, "abandoned": where})
        move_checkpoints(root, newer, segment.lineage, abandoned)
        print(
            f"[memtrain] resuming from step {loaded.step} truncates this run: checkpoints of steps "
            f"{describe_steps(newer)} moved to {abandoned}; new lineage {segment.lineage}",
            flush=True,
        )
    else:
        if event == "fork":
            print(
                f"[memtrain] resuming from {loaded.path} forks that run into {run_dir}: new lineage "
                f"{segment.lineage}, parent step {loaded.step} of lineage {meta.get('lineage')}",
                flush=True,
            )
        append_record(run_dir, record)
    abandon_rows_after(RunLayout(run_dir).metrics_file, loaded.step, RunLayout(abandoned).metrics_file)
    save_recipe(run_dir, recipe)
    if changes:
        print(f"[memtrain] the recipe changed since the checkpoint: {describe_changes(changes)}", flush=True)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
