"""The checkpoint lifecycle of a run: list, pick, stage, commit, replace, prune and recover.

Layout: `<run>/checkpoints/step_00000010/` holding `model.pt`, `optimizer.pt`, `rng_rank<r>.pt` and
`meta.json`. Only `step_<8 digits>` directories are checkpoints (`list_checkpoints`); every name this
module uses on the way ends in `.tmp` and is never listed:

- `step_X.tmp/`: the staging directory. Every file is written there, flushed to disk, meta.json last,
  and the directory is renamed into place only when complete: a crash mid-save leaves the previous
  checkpoint intact.
- `step_X.old.tmp/`: a checkpoint being replaced (the same step saved again, e.g. after a fallback).
  The old one is renamed aside whole, the new one renamed in, then the old deleted. A crash between the
  two renames leaves no `step_X` at all, and `recover` (run at the start of every `fit`) renames the old
  one back, so `step_X` is always either the whole old or the whole new checkpoint.
- `step_X.tmp/` again for pruning: the checkpoint just saved and the newest `keep - 1` older ones are
  kept (a newer step directory, a damaged one a fallback skipped, is neither counted nor deleted), and an
  old one is renamed out of the listing before it is deleted, so a crash mid-prune never leaves a
  half-deleted checkpoint that looks complete. Only these names are removed as leftovers (`OWN_TMP`): a
  user's other `*.tmp` in checkpoints/ stay.

None of these deletions follows a symlink (`confine.remove_tree`: a link planted at a `.tmp` name is
unlinked, its target untouched), and the `checkpoints/` folder itself must stay inside the run
(`confine.check_run_paths`, before anything is saved). `recover` removes whatever such directories a crash left (the next save would too, but a run killed
during its last prune saves nothing again); it runs under the run directory's lock
(`memtrain.run.lock`), so it never deletes another writer's staging directory. Every rename of
a checkpoint directory goes through `move_dir`. A `step_*` directory is therefore always whole unless
something outside memtrain damaged it, so one with a damaged or missing meta.json is still listed, and
fails with an error naming the file (or is skipped by `checkpoint.fallback`).

A full disk (ENOSPC, or EDQUOT for a quota) while saving is `DiskFullError`, one line naming the
directory, the size of a checkpoint and the intact previous one; the staging directory is removed.

meta.json also carries the run's lineage and resolved recipe (`memtrain.run.lineage`). The tensor files
themselves are written and read by `memtrain.checkpoint` (tensor-file IO, shared with the sharding
backends), which knows nothing about runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtrain import checkpoint as tensor_files
from memtrain import json_out
from memtrain.checkpoint import CheckpointError
from memtrain.json_out import DISK_FULL
from memtrain.jsonfile import FileRefused, parse_json, read_regular_file
from memtrain.memory.values import format_bytes
from memtrain.run.confine import remove_tree
from memtrain.run.layout import STEP_DIR, CheckpointFiles, step_dir_name

STAGING_SUFFIX = ".tmp"  # staging, pruning and trash directories all end so: never listed
TRASH_SUFFIX = ".old.tmp"  # a checkpoint renamed aside while the same step is replaced
OWN_TMP = re.compile(r"^step_\d{8}(\.old)?\.tmp$")  # the only .tmp names memtrain makes (and removes) here
MAX_META_BYTES = 32 * 2**20  # meta.json: the resolved recipe (yamlfile bounds it) and the plan, with margin


class DiskFullError(CheckpointError):
    """No space (or quota) left while saving a checkpoint; the previous checkpoint is intact."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    @property
    def meta(self) -> dict[str, Any]:
        """meta.json, read and checked when asked for (a damaged one must not hide the others)."""
        return read_meta(self.path, self.step)

    @property
    def files(self) -> CheckpointFiles:
        return CheckpointFiles(self.path)


# meta.json fields memtrain reads on resume, and their JSON types.
META_TYPES: dict[str, type] = {
    "step": int,
    "world_size": int,
    "plan": dict,
    "skipped_steps": int,
    "model_section": dict,
    "format": str,  # the backend's checkpoint format (memtrain.strategies.sharding.sharded_checkpoint)
}


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Checkpoint directories under `root`, oldest first (`.tmp` directories are not checkpoints, nor is a
    symlink: memtrain renames its checkpoints, never links them, and one linked out of the run would be
    read on resume and pruned through; `confine.check_run_paths` refuses it by name)."""
    if not root.is_dir():
        return []
    found = [
        Checkpoint(child, int(match.group(1)))
        for child in root.iterdir()
        if (match := STEP_DIR.match(child.name)) and _real_dir(child)
    ]
    return sorted(found, key=lambda c: c.step)


def read_meta(path: Path, step: int | None = None) -> dict[str, Any]:
    """The checkpoint's meta.json; CheckpointError naming the file when it is missing or damaged."""
    file = CheckpointFiles(path).meta
    try:
        meta = parse_json(read_regular_file(file, MAX_META_BYTES))
    except FileNotFoundError:
        raise CheckpointError(
            f"{file}: unreadable checkpoint metadata (missing; it is written last)"
        ) from None
    except FileRefused as exc:  # a symlink, a FIFO, too large, not UTF-8, not JSON, nested too deeply
        raise CheckpointError(f"{file}: unreadable checkpoint metadata ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: checkpoint metadata must be a JSON object, not {type(meta).__name__}")
    wrong = [
        f"{key} is not {kind.__name__}"
        for key, kind in META_TYPES.items()
        if key in meta and not isinstance(meta[key], kind)
    ]
    if wrong:
        raise CheckpointError(f"{file}: damaged checkpoint metadata ({'; '.join(wrong)})")
    if step is not None and meta.get("step", step) != step:
        raise CheckpointError(f"{file}: says step {meta['step']}, but its directory is step {step}")
    return meta


def find_checkpoint(location: Path) -> Checkpoint:
    """`location` is one checkpoint directory or a directory of them (the newest is taken)."""
    match = STEP_DIR.match(location.name)
    if match and location.is_dir():
        return Checkpoint(location, int(match.group(1)))
    found = list_checkpoints(location)
    if not found:
        raise CheckpointError(
            f"no checkpoint under {location}; train without --resume or point --resume at one"
        )
    return found[-1]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(root: Path, step: int) -> Path:
    return root / f"{step_dir_name(step)}{STAGING_SUFFIX}"


def trash_dir(root: Path, step: int) -> Path:
    return root / f"{step_dir_name(step)}{TRASH_SUFFIX}"


def move_dir(source: Path, target: Path) -> None:
    """Rename a checkpoint directory (atomic within one filesystem): every such rename goes through here."""
    os.replace(source, target)


def recover(root: Path) -> None:
    """At the start of a run, under its lock: rename back a checkpoint set aside by a replace that died
    before the new one was renamed in, then remove every staging, pruning and trash directory left."""
    if not root.is_dir():
        return
    for trash in root.glob(f"*{TRASH_SUFFIX}"):
        final = trash.with_name(trash.name[: -len(TRASH_SUFFIX)])
        if STEP_DIR.match(final.name) and not os.path.lexists(final) and _real_dir(trash):
            move_dir(trash, final)
    for stale in own_leftovers(root):
        remove_tree(stale)


def own_leftovers(root: Path) -> list[Path]:
    """The staging, pruning and trash names memtrain makes in `root` (a user's other `*.tmp` stay)."""
    return [path for path in root.glob(f"*{STAGING_SUFFIX}") if OWN_TMP.match(path.name)]


def _real_dir(path: Path) -> bool:
    """A directory itself, not a symlink to one (memtrain renames its own directories, never links)."""
    return path.is_dir() and not path.is_symlink()


def begin_save(root: Path, step: int) -> Path:
    """Create an empty staging directory for `step` (called on rank 0 before the others write)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in own_leftovers(root):
        remove_tree(stale)  # a symlink planted here is unlinked, its target untouched
    staging = staging_dir(root, step)
    staging.mkdir()  # a new directory (exclusive): the files below are written into nothing else
    return staging


def commit_save(root: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Write meta.json last, rename the staging directory into place (an existing checkpoint of the same
    step is renamed aside first and deleted after), then prune old checkpoints."""
    staging = staging_dir(root, step)
    encoded = json_out.dumps(meta, indent=2, sort_keys=True).encode()
    if len(encoded) > MAX_META_BYTES:  # never write what `read_meta` refuses (the recipe is bounded at load)
        raise CheckpointError(
            f"{CheckpointFiles(staging).meta}: {len(encoded):,} bytes, over what read_meta reads"
        )
    tensor_files.write_file(CheckpointFiles(staging).meta, lambda h: h.write(encoded))
    _fsync_dir(staging)
    final = root / step_dir_name(step)
    trash = trash_dir(root, step) if os.path.lexists(final) else None
    if trash is not None:  # (begin_save removed any older one)
        move_dir(final, trash)  # out of the listing whole; `recover` puts it back if we die here
    move_dir(staging, final)
    _fsync_dir(root)
    if trash is not None:
        remove_tree(trash)
    prune(root, step, keep)
    return final


def prune(root: Path, saved: int, keep: int) -> None:
    """Delete the checkpoints older than the one just `saved` but the newest `keep - 1` of them. A newer
    step directory (a damaged one a `checkpoint.fallback` resume skipped) is neither counted nor deleted:
    counting it deleted the checkpoint just saved, leaving only the damaged one."""
    older = [c for c in list_checkpoints(root) if c.step < saved]
    for old in older[: max(0, len(older) - (keep - 1))]:
        doomed = old.path.with_name(old.path.name + STAGING_SUFFIX)  # out of the listing in one rename
        move_dir(old.path, doomed)
        remove_tree(doomed)


def abort_save(root: Path, step: int) -> None:
    """Remove the staging directory of a save that failed (the previous checkpoints are untouched)."""
    remove_tree(staging_dir(root, step))


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` is, or was raised while handling, an out-of-space or out-of-quota OSError (torch.save
    wraps the file's OSError in a RuntimeError)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def disk_full_error(root: Path, step: int) -> DiskFullError:
    """The one-line error for a save of `step` that ran out of space: what a checkpoint needs and what is
    free (when known), which checkpoint is intact, and what to do."""
    previous = list_checkpoints(root)
    known = []
    with contextlib.suppress(OSError):  # only for the message: a failure to measure leaves the figure out
        if previous:
            size = sum(f.stat().st_size for f in previous[-1].path.rglob("*") if f.is_file())
            known.append(f"a checkpoint needs about {format_bytes(size)}")
        known.append(f"{format_bytes(shutil.disk_usage(root).free)} free")
    intact = (
        f"the previous checkpoint (step {previous[-1].step}) is intact"
        if previous
        else "there is no earlier checkpoint"
    )
    sizes = f" ({', '.join(known)})" if known else ""
    return DiskFullError(
        f"no space left on the device (or disk quota exceeded) saving checkpoint step {step} in {root}"
        f"{sizes}; {intact}. Free disk space, or copy the run directory to a disk with room and set "
        "run.output_dir to it, then continue with --resume"
    )
