"""The command line: bad input exits 2 with a message naming the key and no traceback; the default
recipe trains and its loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memtrain.cli import main
from memtrain.training.metrics import read_metrics

from helpers import REPO, subprocess_env


def _memtrain(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memtrain", *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


BAD_INPUTS = {
    "malformed yaml": ("train:\n  steps: [3\n", "malformed YAML"),
    "unknown key": ("trian:\n  steps: 3\n", 'did you mean "train"'),
    "wrong type": ("train:\n  steps: lots\n", "train.steps"),
    "unknown model type": ("model:\n  config:\n    model_type: lama\n", 'did you mean "llama"'),
    "too long sequence": (
        "model:\n  config: {model_type: gpt2, n_positions: 32, n_embd: 16, n_layer: 1, n_head: 2}\ndata:\n  seq_len: 64\n",
        "data.seq_len",
    ),
    "missing data file": (
        "model:\n  config: {model_type: gpt2, n_embd: 16, n_layer: 1, n_head: 2}\ndata:\n  source: text\n  path: nowhere.txt\n",
        "nowhere.txt",
    ),
    "pinned paged-8bit on CPU": (
        "model:\n  config: {model_type: gpt2, n_embd: 16, n_layer: 1, n_head: 2, vocab_size: 64}\n"
        "data: {seq_len: 8, synthetic: {num_samples: 64}}\nstrategies: {optimizer_states: paged-8bit}\n",
        "strategies.optimizer_states",
    ),
    "pinned fp8 on CPU": (
        "model:\n  config: {model_type: gpt2, n_embd: 16, n_layer: 1, n_head: 2, vocab_size: 64}\n"
        "data: {seq_len: 8, synthetic: {num_samples: 64}}\nstrategies: {precision: fp8}\n",
        "compute capability >= 8.9",
    ),
    "unknown strategy name": ("strategies:\n  checkpointing: selectve\n", 'did you mean "selective"'),
    "batch not divisible": (
        "model:\n  config: {model_type: gpt2, n_embd: 16, n_layer: 1, n_head: 2, vocab_size: 64}\n"
        "data: {seq_len: 8, synthetic: {num_samples: 64}}\nbatch: {global_size: 6, micro_size: 4}\n",
        "batch.global_size",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_exits_2_with_named_key(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text, expected = BAD_INPUTS[case]
    path = tmp_path / "recipe.yaml"
    path.write_text(text + f"run:\n  output_dir: {tmp_path / 'run'}\noutput:\n  progress: 'off'\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text("train:\n  stepz: 3\n")
    done = _memtrain("validate", str(path))
    assert done.returncode == 2
    assert 'train.stepz: unknown key (did you mean "steps"?)' in done.stderr
    assert "Traceback" not in done.stderr


def test_schema_and_validate(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process (the process boundary is the subprocess test's): two child processes cost ~15 s."""
    monkeypatch.chdir(REPO)
    assert main(["schema"]) == 0
    assert "strategies" in json.loads(capsys.readouterr().out)["properties"]
    assert main(["validate", "recipes/llama3-8b-8xh100.yaml"]) == 0
    assert "ok (llama" in capsys.readouterr().out


@pytest.mark.slow
def test_default_recipe_trains_and_loss_falls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's claim, `memtrain train recipes/default.yaml`, run in this process (a child process adds
    its imports, ~7 s, and shows nothing more: the subprocess test is about the process boundary). The first
    90 of its 300 steps, evaluating and checkpointing every 30 (the whole run is 2 of this file's 2 minutes;
    its loss went 5.21 -> 2.71 over these 90 steps; scripts/train.sh times the whole run, BENCHMARKS)."""
    monkeypatch.chdir(REPO)
    short = ["train.steps=90", "train.eval_every=30", "checkpoint.every=30"]
    assert main(["train", "recipes/default.yaml", f"run.output_dir={tmp_path / 'run'}", *short]) == 0
    losses = [row["loss"] for row in read_metrics(tmp_path / "run/metrics.jsonl")]
    assert len(losses) == 90
    assert sum(losses[-20:]) / 20 < 0.6 * sum(losses[:5]) / 5
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["steps"] == 90 and summary["peak_memory_bytes"] > 0
    evals = [row["eval_loss"] for row in read_metrics(tmp_path / "run/metrics.jsonl") if "eval_loss" in row]
    assert len(evals) == 3 and evals[-1] < evals[0]
