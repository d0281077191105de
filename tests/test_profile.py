"""`memtrain profile` writes memory.json (schema checked), the PNG and the HTML timeline; the simulated
device budget stops a real run with torch.OutOfMemoryError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cli import main
from memtrain.memory import COMPONENTS

from helpers import REPO, tiny_recipe


def test_profile_writes_reports_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "prof"
    assert main(["profile", "recipes/default.yaml", "--steps", "3", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    on_disk = json.loads((out / "memory.json").read_text())
    assert printed == on_disk
    assert isinstance(on_disk["device"], str)
    for key in ("peak_bytes", "first_step_peak_bytes", "steady_peak_bytes"):
        assert isinstance(on_disk[key], int) and on_disk[key] > 0
    assert set(on_disk["at_peak"]) == set(COMPONENTS)
    assert all(isinstance(v, int) for v in on_disk["at_peak"].values())
    assert sum(on_disk["at_peak"].values()) == on_disk["peak_bytes"]
    assert on_disk["peak_phase"] in ("forward", "backward", "optimizer", "other")
    assert isinstance(on_disk["peak_module"], str)
    assert [s["step"] for s in on_disk["steps"]] == [1, 2, 3]
    (only,) = on_disk["ranks"]  # every rank's components at its peak, with its mesh coordinates
    assert only["rank"] == 0
    assert only["coordinates"] == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert set(only["at_peak"]) == set(COMPONENTS) and sum(only["at_peak"].values()) == only["peak_bytes"]
    for step in on_disk["steps"]:
        assert isinstance(step["peak_bytes"], int)
        assert set(step["phase_peaks"]) <= {"forward", "backward", "optimizer", "other"}
    # Adam's moments are created lazily in step 1's optimizer phase: the first-step report says so.
    assert on_disk["first_step"]["created_lazily"]["optimizer_states"]["phase"] == "optimizer"
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "timeline.html").read_text()
    assert "<svg" in html
    for external in ('src="http', "src='http", 'href="http', "href='http", "@import"):
        assert external not in html, "the page must not load anything from the network"


def test_profile_table_names_components(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    assert main(["profile", "recipes/default.yaml", "--steps", "2", "--out", str(tmp_path / "p")]) == 0
    table = capsys.readouterr().out
    for component in COMPONENTS:
        assert component in table


def test_simulated_budget_raises_real_oom(tmp_path: Path) -> None:
    fits = CausalLMTrainer(tiny_recipe(tmp_path / "ok", memory={"budget": "64MiB"}))
    result = fits.fit()
    measured_peak = max(r.peak_bytes for r in fits.monitor.memory_reports)
    assert len(result.losses) == 4
    tight = CausalLMTrainer(tiny_recipe(tmp_path / "tight", memory={"budget": measured_peak - 1}))
    assert len(tight.fit().losses) == 4
    assert tight.monitor.oom_events, (
        "one byte short: a real OutOfMemoryError, recovered by smaller micro-batches"
    )
    assert "Simulated device out of memory" in tight.monitor.oom_events[0]["error"]
    exact = CausalLMTrainer(tiny_recipe(tmp_path / "exact", memory={"budget": measured_peak}))
    assert len(exact.fit().losses) == 4
    assert not exact.monitor.oom_events
