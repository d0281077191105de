"""Run directories, run files, data files and export as untrusted input, round four (issue 43): memtrain's
own files are read through one bounded reader, what it prunes and appends to is only what it wrote, export
copies nothing from outside the run, and bad data files or recipes end as one line, quickly.

Each test names the hole it closes and fails on the code before the fix.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from memtrain import cli
from memtrain.causal_lm import sft
from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.tokenizer import load_tokenizer
from memtrain.checkpoint import CheckpointError
from memtrain.errors import MemtrainError, RecipeError
from memtrain.run import RunDirectory, RunLayout, lineage, lock, metrics_rows
from memtrain.run import checkpoints as ckpt
from memtrain.strategies.sharding.safe_readers import read_dcp_metadata

from fault_kit.run_dir_faults import copy_of
from fault_kit.scenarios import in_process, write_recipe
from helpers import REPO, tiny_recipe_dict

TOKENIZER = REPO / "data" / "tiny-sft-tokenizer"
SECRET = b"someone else's file\n"


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run on text data with the shipped tokenizer directory: checkpoints at 2 and 3."""
    base = tmp_path_factory.mktemp("finished")
    text = base / "data.txt"
    text.write_text("".join(f"line {i} of the tiny corpus, long enough to pack.\n" for i in range(200)))
    raw = tiny_recipe_dict(
        base,
        train={"steps": 3},
        checkpoint={"every": 2, "keep": 3, "at_end": True},
        data={"source": "text", "path": str(text), "tokenizer": str(TOKENIZER)},
    )
    raw["model"]["config"]["vocab_size"] = 320  # the shipped tokenizer's
    recipe = write_recipe(base / "recipe.yaml", raw)
    rc, _, err = in_process(cli.main, ["train", str(recipe)])
    assert rc == 0, err
    return base


def steps(run: Path) -> list[int]:
    return [c.step for c in ckpt.list_checkpoints(RunLayout(run).checkpoints)]


def one_line_error(argv: list[str], *expected: str) -> str:
    """`memtrain ARGV` exits 2 with one error line holding every `expected`, no traceback."""
    rc, _, err = in_process(cli.main, argv)
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert rc == 2 and "Traceback" not in err and len(errors) == 1, (rc, err[-2000:])
    for text in expected:
        assert text in err, (text, err[-2000:])
    return err


def returns_within(seconds: float, call: Any, unblock: Path | None = None) -> Any:
    """`call()`'s result or exception, required within `seconds` (a FIFO `unblock` is opened for writing
    afterwards, so a reader stuck on it ends and the test process can too)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    blocked = thread.is_alive()
    if blocked and unblock is not None:
        os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    assert not blocked, f"still running after {seconds} s"
    return outcome


# ------------------------------------------------------------------------------- the bounded reader


def test_a_50_mb_meta_json_is_refused_unread(tmp_path: Path) -> None:
    """Hole: a 50 MB meta.json was read whole and accepted (memtrain writes kilobytes there)."""
    step = tmp_path / "step_00000001"
    step.mkdir()
    (step / "meta.json").write_text('{"step": 1, "pad": "' + "x" * (50 * 2**20) + '"}')
    with pytest.raises(CheckpointError, match="meta.json: unreadable checkpoint metadata .*over 32 MiB"):
        ckpt.read_meta(step, 1)


def test_meta_json_nested_100k_deep_is_one_line(tmp_path: Path) -> None:
    """Hole: `json.loads` raised RecursionError, a traceback, past read_meta's handler."""
    step = tmp_path / "step_00000001"
    step.mkdir()
    (step / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested more than 64 levels"):
        ckpt.read_meta(step, 1)


@pytest.mark.parametrize("name", ["meta", "recipe"])
def test_a_fifo_in_place_of_a_run_file_never_blocks(tmp_path: Path, name: str) -> None:
    """Hole: meta.json or recipe.json as a FIFO made resume (holding the run's lock) and export wait
    forever for a writer."""
    run = RunDirectory(tmp_path / "run")
    step = run.layout.checkpoints / "step_00000001"
    step.mkdir(parents=True)
    fifo = step / "meta.json" if name == "meta" else run.layout.recipe_file
    os.mkfifo(fifo)
    read = (lambda: ckpt.read_meta(step, 1)) if name == "meta" else run.read_recipe
    outcome = returns_within(5.0, read, unblock=fifo)
    assert isinstance(outcome.get("error"), MemtrainError), outcome
    assert "not a regular file" in str(outcome["error"])


def test_a_fifo_as_dcp_metadata_never_blocks(tmp_path: Path) -> None:
    """Hole: `dcp/.metadata` as a FIFO made a resume of a zero2/zero3 checkpoint wait for a writer."""
    fifo = tmp_path / ".metadata"
    os.mkfifo(fifo)
    outcome = returns_within(5.0, lambda: read_dcp_metadata(fifo), unblock=fifo)
    assert isinstance(outcome.get("error"), CheckpointError), outcome
    assert "not a regular file" in str(outcome["error"])


def test_a_meta_json_symlinked_outside_is_not_read(tmp_path: Path) -> None:
    """Hole: meta.json linked to a file outside the run was read (and steered the resume)."""
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"step": 1}))
    step = tmp_path / "run" / "step_00000001"
    step.mkdir(parents=True)
    (step / "meta.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="a symlink"):
        ckpt.read_meta(step, 1)


def test_export_with_a_deep_recipe_json_is_one_line(finished: Path, tmp_path: Path) -> None:
    """Hole: read_recipe's `json.loads` raised RecursionError: a traceback from `memtrain export`."""
    _, run = copy_of(finished, tmp_path)
    RunLayout(run).recipe_file.write_text("[" * 100_000 + "]" * 100_000)
    one_line_error(["export", str(run), "--out", str(tmp_path / "hf")], "recipe.json", "nested more than 64")


def test_metrics_rows_are_set_aside_line_by_line(tmp_path: Path) -> None:
    """metrics.jsonl is streamed, not read whole (a long run's file may exceed memory): the rows past the
    step, and from a line longer than any row memtrain writes on, everything, move aside byte for byte."""
    rows = [json.dumps({"step": step, "loss": 1.0}).encode() + b"\n" for step in (1, 2, 3)]
    long_line = b'{"step": 2, "pad": "' + b"x" * (metrics_rows.MAX_ROW_BYTES + 1) + b'"}\n'
    path, aside = tmp_path / "metrics.jsonl", tmp_path / "abandoned" / "metrics.jsonl"
    path.write_bytes(rows[0] + long_line + rows[2])
    assert metrics_rows.abandon_rows_after(path, 5, aside) == 2
    assert path.read_bytes() == rows[0] and aside.read_bytes() == long_line + rows[2]
    path.write_bytes(rows[0] + rows[1] + rows[2][:-1])  # a last row without its newline
    assert metrics_rows.abandon_rows_after(path, 1, aside) == 2
    assert path.read_bytes() == rows[0] and aside.read_bytes().endswith(rows[1] + rows[2])


# ------------------------------------------------------------------------------------------ export


def test_export_copies_the_tokenizer_the_run_kept(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    rc, _, err = in_process(cli.main, ["export", str(finished / "run"), "--out", str(out)])
    assert rc == 0, err
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (TOKENIZER / name).read_bytes(), name


def test_export_never_copies_from_a_path_recipe_json_names(finished: Path, tmp_path: Path) -> None:
    """Hole: export copied the files of the `data.tokenizer` directory recipe.json names, anywhere on the
    machine, into the export (a read outside the run, handed on with the model)."""
    _, run = copy_of(finished, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tokenizer.json").write_bytes(SECRET)
    (outside / "vocab.txt").write_bytes(SECRET)
    raw = json.loads(RunLayout(run).recipe_file.read_text())
    raw["data"]["tokenizer"] = str(outside)
    RunLayout(run).recipe_file.write_text(json.dumps(raw))
    out = tmp_path / "hf"
    rc, _, err = in_process(cli.main, ["export", str(run), "--out", str(out)])
    assert rc == 0, err
    assert not (out / "vocab.txt").exists()
    assert (out / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()


def test_export_of_a_run_without_a_kept_tokenizer_reads_nothing_outside(
    finished: Path, tmp_path: Path
) -> None:
    """A run trained before memtrain kept its tokenizer: the export has none (a warning says so)."""
    _, run = copy_of(finished, tmp_path)
    shutil.rmtree(RunLayout(run).tokenizer_dir)
    out = tmp_path / "hf"
    with pytest.warns(UserWarning, match="holds no copy of its tokenizer"):
        rc, _, err = in_process(cli.main, ["export", str(run), "--out", str(out)])
    assert rc == 0, err
    assert not (out / "tokenizer.json").exists()


def test_a_tokenizer_folder_symlinked_outside_is_refused(finished: Path, tmp_path: Path) -> None:
    _, run = copy_of(finished, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tokenizer.json").write_bytes(SECRET)
    shutil.rmtree(RunLayout(run).tokenizer_dir)
    RunLayout(run).tokenizer_dir.symlink_to(outside)
    one_line_error(["export", str(run), "--out", str(tmp_path / "hf")], "outside the run directory")


# ----------------------------------------------------------------------------------------- pruning


def test_fallback_with_keep_1_never_prunes_the_checkpoint_just_saved(finished: Path, tmp_path: Path) -> None:
    """Hole: with a damaged newest step directory, a `checkpoint.fallback` resume trained on from the one
    before and `keep: 1` counted the damaged one as the newest: every real checkpoint, the one just saved
    included, was deleted (exit 0, nothing to resume from)."""
    recipe, run = copy_of(finished, tmp_path)
    damaged = RunLayout(run).checkpoints / "step_00000009"
    damaged.mkdir()
    (damaged / "meta.json").write_text("{damaged")
    argv = ["train", str(recipe), "--resume", "auto", "train.steps=4"]
    rc, _, err = in_process(cli.main, [*argv, "checkpoint.keep=1", "checkpoint.fallback=true"])
    assert rc == 0, err
    assert steps(run) == [4, 9]
    assert ckpt.read_meta(RunLayout(run).checkpoints / "step_00000004", 4)["step"] == 4


def test_a_step_directory_symlinked_outside_is_refused_not_read(finished: Path, tmp_path: Path) -> None:
    """Hole: a `step_*` symlink to a checkpoint outside the run was read on resume (its state saved into
    the run) and pruning went through it."""
    recipe, run = copy_of(finished, tmp_path)
    outside = tmp_path / "elsewhere" / "step_00000009"
    shutil.copytree(RunLayout(run).checkpoints / "step_00000003", outside)
    (outside / "meta.json").write_text((outside / "meta.json").read_text().replace('"step": 3', '"step": 9'))
    link = RunLayout(run).checkpoints / "step_00000009"
    link.symlink_to(outside, target_is_directory=True)
    assert steps(run) == [2, 3]  # not a checkpoint of the run: never listed, never read
    before = sorted(p.name for p in outside.iterdir())
    argv = ["train", str(recipe), "--resume", "auto", "train.steps=12", "checkpoint.keep=1"]
    one_line_error(argv, "step_00000009", "is a symlink")
    assert sorted(p.name for p in outside.iterdir()) == before and steps(run) == [2, 3]


def test_a_checkpoint_file_symlinked_outside_is_not_read(finished: Path, tmp_path: Path) -> None:
    """Hole: `model.pt` linked to a file outside the run was loaded (weights from anywhere the link led)."""
    recipe, run = copy_of(finished, tmp_path)
    model = RunLayout(run).checkpoints / "step_00000003" / "model.pt"
    outside = tmp_path / "outside.pt"
    shutil.move(model, outside)
    model.symlink_to(outside)
    one_line_error(["train", str(recipe), "--resume", "auto", "train.steps=4"], "model.pt: is a symlink")


def test_pruning_leaves_a_users_tmp_files(finished: Path, tmp_path: Path) -> None:
    """Hole: every `*.tmp` in checkpoints/ was deleted at the start of a run and at each save."""
    recipe, run = copy_of(finished, tmp_path)
    root = RunLayout(run).checkpoints
    (root / "notes.tmp").write_text("mine")
    (root / "scratch.tmp").mkdir()
    (root / "scratch.tmp" / "data").write_text("mine")
    stale = ckpt.staging_dir(root, 7)
    stale.mkdir()  # a staging directory a crash left: memtrain's, removed
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=4"])
    assert rc == 0, err
    assert (root / "notes.tmp").read_text() == "mine" and (root / "scratch.tmp" / "data").is_file()
    assert not stale.exists() and steps(run) == [2, 3, 4]


# ------------------------------------------------------------------------------------------ hard links


def test_a_fresh_run_never_truncates_a_hard_linked_metrics_file(tmp_path: Path) -> None:
    """Hole: a fresh run emptied metrics.jsonl in place, and with it every other name of that file."""
    outside = tmp_path / "precious.jsonl"
    outside.write_bytes(SECRET)
    raw = tiny_recipe_dict(tmp_path, train={"steps": 1})
    run = Path(raw["run"]["output_dir"])
    run.mkdir()
    os.link(outside, RunLayout(run).metrics_file)
    rc, _, err = in_process(cli.main, ["train", str(write_recipe(tmp_path / "r.yaml", raw))])
    assert rc == 0, err
    assert outside.read_bytes() == SECRET
    assert len(RunLayout(run).metrics_file.read_text().splitlines()) == 1


def test_resuming_a_cp_al_copy_leaves_the_original_run_untouched(finished: Path, tmp_path: Path) -> None:
    """Hole: `cp -al RUN COPY` shares every file; a resume of COPY appended its metrics rows and lineage
    record to RUN's files (and wrote its lock holder into RUN's lock file)."""
    original = tmp_path / "original"
    shutil.copytree(finished / "run", original)
    copy = tmp_path / "run"
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    raw = json.loads(RunLayout(copy).recipe_file.read_text())
    raw["run"]["output_dir"] = str(copy)
    recipe = write_recipe(tmp_path / "recipe.yaml", raw)
    names = ("metrics.jsonl", "lineage.jsonl", ".memtrain.lock", "recipe.json", "plan.json")
    before = {name: (original / name).read_bytes() for name in names}
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=4"])
    assert rc == 0, err
    assert {name: (original / name).read_bytes() for name in names} == before
    assert steps(original) == [2, 3] and steps(copy) == [2, 3, 4]
    assert len((copy / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_hard_linked_lock_file_is_replaced_and_stays_locked_until_release(tmp_path: Path) -> None:
    """Hole: the holder was written into a lock file another name shares (the original run's, after
    `cp -al`). Now the run gets a lock file of its own, and the shared one stays locked while it runs (a
    process that opened it before the rename must still find the run in use)."""
    run = tmp_path / "run"
    run.mkdir()
    shared = tmp_path / "original.lock"
    shared.write_bytes(b"")
    os.link(shared, RunLayout(run).lock_file)
    held = lock.acquire(run)
    try:
        assert not os.path.samefile(shared, RunLayout(run).lock_file)
        assert shared.read_bytes() == b"" and lock.read_holder(RunLayout(run).lock_file) is not None
        with shared.open("rb") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        held.release()
    with shared.open("rb") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


# ------------------------------------------------------------------------------------------ recipes


def test_one_string_aliased_89_times_is_refused_at_load(tmp_path: Path) -> None:
    """Hole: a 978 KB recipe whose one 1 MB string was aliased 89 times passed the count of values and
    wrote 352 MiB of run files (the recipe in recipe.json, lineage.jsonl and every meta.json); the next
    resume refused memtrain's own lineage.jsonl as too large."""
    raw = tiny_recipe_dict(tmp_path)
    text = yaml.safe_dump(raw) + "notes:\n  text: &big " + "x" * 1_000_000 + "\n  copies: ["
    text += ", ".join(["*big"] * 89) + "]\n"
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert path.stat().st_size < 2**20
    started = time.perf_counter()
    for command in ("validate", "train"):
        one_line_error([command, str(path)], "notes", "characters of text")
    assert time.perf_counter() - started < 30
    assert not (tmp_path / "run").exists()


def test_memtrain_never_appends_past_what_it_reads_back_of_lineage_jsonl(tmp_path: Path) -> None:
    """Hole: append_record wrote lineage.jsonl past the 64 MiB that `read_records` refuses, so the next
    resume refused memtrain's own file."""
    path = RunLayout(tmp_path).lineage_file
    with path.open("wb") as handle:  # sparse: 64 MiB long, almost nothing on disk
        handle.seek(lineage.MAX_LINEAGE_BYTES - 100)
        handle.write(b"\n")
    size = path.stat().st_size
    with pytest.raises(lineage.LineageDamaged, match="past 64 MiB"):
        lineage.append_record(tmp_path, {"event": "start", "recipe": {"x": "y" * 200}})
    assert path.stat().st_size == size


@pytest.mark.parametrize("name", ["..", "../../x", "a/../../b"])
def test_a_run_name_that_leaves_runs_is_refused(tmp_path: Path, name: str) -> None:
    """Hole: `run.name: ..` or `../../x` (with no run.output_dir) put the run outside runs/."""
    raw = tiny_recipe_dict(tmp_path)
    raw["run"] = {"name": name}
    path = write_recipe(tmp_path / "r.yaml", raw)
    for command in ("validate", "train"):
        one_line_error([command, str(path)], "run.name", "one folder name under runs/")


def test_10k_unknown_override_keys_give_a_short_message(tmp_path: Path) -> None:
    """Hole: 10,000 unknown override keys gave a 269 KB error message, one line each."""
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe_dict(tmp_path))
    overrides = [f"train.unknown_key_{i}=1" for i in range(10_000)]
    rc, _, err = in_process(cli.main, ["validate", str(path), *overrides])
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert "10,000 problems" in err and "and 9,980 more" in err and len(err) < 5000, len(err)


# --------------------------------------------------------------------------------------- trainer hooks


@pytest.mark.parametrize("command", ["train", "validate", "profile"])
def test_sys_exit_0_in_a_trainer_hook_is_a_failure_naming_it(tmp_path: Path, command: str) -> None:
    """Hole: a `--trainer` hook calling `sys.exit(0)` ended `train` with exit 0 and no message, read as a
    finished run."""
    trainer = tmp_path / "my_trainer.py"
    trainer.write_text(
        "import sys\n"
        "from memtrain.causal_lm.trainer import CausalLMTrainer\n\n\n"
        "class Quitter(CausalLMTrainer):\n"
        "    def build_model(self):\n"
        "        sys.exit(0)\n"
    )
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe_dict(tmp_path))
    err = one_line_error(
        [command, str(path), "--trainer", f"{trainer}:Quitter"], "hook build_model", "sys.exit(0)"
    )
    assert "my_trainer.py, line 7" in err


# -------------------------------------------------------------------------------------------- data


def test_a_chat_row_of_100k_turns_is_refused_at_once(tmp_path: Path) -> None:
    """Hole: labelling a chat row renders every prefix, time growing with the square of the turns: one row
    of 100k turns hung past 420 s (2k: 44 s). Over the bound it is one line naming the key, at once."""
    tokenizer = load_tokenizer(str(TOKENIZER))
    cfg = DataConfig(source="jsonl", kind="chat", tokenizer=str(TOKENIZER), path="chat.jsonl")
    encoder = sft.RecordEncoder(cfg, tokenizer)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(100_000)]
    with pytest.raises(RecipeError, match="600 messages, over the 512 whose assistant turns"):
        encoder({"messages": turns[:600]}, "row 1")  # the shipped template: labelled by prefixes
    started = time.perf_counter()
    with pytest.raises(RecipeError, match="data.kind: chat row 1: 100,000 messages, over the 8,192"):
        encoder({"messages": turns}, "row 1")
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize("content", [b"", b"\0" * 4096])
def test_a_zeroed_parquet_file_is_one_line_naming_it(tmp_path: Path, content: bytes) -> None:
    """Hole: a zeroed (or empty) parquet file printed pyarrow's error through datasets' logger, then named
    the folder or glob, not the file."""
    folder = tmp_path / "parquet"
    folder.mkdir()
    (folder / "part-0.parquet").write_bytes(content)
    raw = tiny_recipe_dict(
        tmp_path, data={"source": "dataset", "path": str(folder), "tokenizer": str(TOKENIZER)}
    )
    raw["model"]["config"]["vocab_size"] = 320
    path = write_recipe(tmp_path / "r.yaml", raw)
    err = one_line_error(["validate", str(path)], "data.path", "part-0.parquet is not a parquet file")
    assert "ArrowInvalid" not in err and len(err.splitlines()) == 2, err


def test_a_fifo_as_data_path_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "data.txt"
    os.mkfifo(fifo)
    raw = tiny_recipe_dict(tmp_path, data={"source": "text", "path": str(fifo), "tokenizer": str(TOKENIZER)})
    raw["model"]["config"]["vocab_size"] = 320
    path = write_recipe(tmp_path / "r.yaml", raw)
    outcome = returns_within(60.0, lambda: in_process(cli.main, ["validate", str(path)]), unblock=fifo)
    rc, _, err = outcome["value"]
    assert rc == 2 and "data.path" in err and "not a regular file" in err, err
