"""Report JSON schema, the table, the timeline (downsampling keeps peaks) and the PNG/HTML files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from memtrain.memory import COMPONENTS, MemoryTracker
from memtrain.memory.plots import timeline_figure
from memtrain.memory.report import format_table, memory_json, write_timeline_html, write_timeline_png
from memtrain.memory.timeline import Timeline

from helpers import tracked_step


@pytest.fixture(scope="module")
def tracker() -> MemoryTracker:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(128, 64)
    tracker = MemoryTracker(model, optimizer)
    with tracker:
        for step in (1, 2, 3):
            tracker.begin_step(step)
            tracked_step(tracker, model, optimizer, x)
            tracker.end_step()
    return tracker


def test_memory_json_schema(tracker: MemoryTracker) -> None:
    report = json.loads(json.dumps(memory_json(tracker.reports, torch.device("cpu"))))
    assert set(report) == {
        "device",
        "peak_bytes",
        "at_peak",
        "peak_phase",
        "peak_module",
        "first_step_peak_bytes",
        "steady_peak_bytes",
        "steps",
    }
    assert report["device"] == "cpu"
    assert set(report["at_peak"]) == set(COMPONENTS)
    assert all(type(v) is int for v in report["at_peak"].values())
    assert (
        sum(report["at_peak"].values()) == report["peak_bytes"] == max(r.peak_bytes for r in tracker.reports)
    )
    assert report["first_step_peak_bytes"] == tracker.reports[0].peak_bytes
    assert report["steady_peak_bytes"] == tracker.reports[1].peak_bytes  # steps 2 and 3 are identical
    assert type(report["peak_phase"]) is str and type(report["peak_module"]) is str
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    for s in report["steps"]:
        assert set(s) == {"step", "peak_bytes", "phase_peaks"}
        assert set(s["phase_peaks"]) >= {"forward", "backward", "optimizer"}
        assert max(s["phase_peaks"].values()) == s["peak_bytes"]
    with pytest.raises(ValueError):
        memory_json([], "cpu")


def test_step_record_is_one_json_line(tracker: MemoryTracker) -> None:
    line = json.dumps(tracker.reports[0].as_dict())
    assert "\n" not in line
    record = json.loads(line)
    assert record["step"] == 1 and record["at_peak"] == tracker.reports[0].at_peak
    assert record["phase_growth"]["optimizer"]["optimizer_states"] > 0


def test_format_table(tracker: MemoryTracker) -> None:
    table = format_table(memory_json(tracker.reports, "cpu"))
    assert table == format_table(max(tracker.reports, key=lambda r: r.peak_bytes))
    lines = table.splitlines()
    assert [line.split()[0] for line in lines[1:6]] == list(COMPONENTS)
    percents = [float(line.split()[2]) for line in lines[1:6]]
    assert sum(percents) == pytest.approx(100, abs=0.3)
    assert "GiB" in lines[0] and "%" in lines[0]


def test_png_has_every_component_in_the_legend(tracker: MemoryTracker, tmp_path: Path) -> None:
    legend = timeline_figure(tracker).axes[0].get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == list(COMPONENTS)
    path = write_timeline_png(tracker, tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000


def test_html_is_self_contained(tracker: MemoryTracker, tmp_path: Path) -> None:
    page = write_timeline_html(tracker, tmp_path / "timeline.html").read_text()
    assert "<svg" in page and page.rstrip().endswith("</html>")
    for network in ('src="http', "src='http", 'href="http', "url(http", "<script src", "<link", "@import"):
        assert network not in page
    for component in COMPONENTS:
        assert component in page
    assert "First step vs steady state" in page and "lazy creation" in page


def test_timeline_downsampling_keeps_the_peak_and_the_first_step() -> None:
    timeline = Timeline(samples_per_step=10, max_steps=3)
    t = 0
    for step in range(1, 6):
        timeline.begin_step(t, step)
        for i in range(1000):
            t += 1
            total = 5_000 + step if i == 637 else i % 50
            timeline.add(t, "forward", dict.fromkeys(COMPONENTS, 0) | {"other": total}, total)
    samples = timeline.samples
    assert sorted({s.step for s in samples}) == [1, 4, 5]
    for step in (1, 4, 5):
        mine = [s for s in samples if s.step == step]
        assert len(mine) <= 20
        assert max(s.total for s in mine) == 5_000 + step
    with pytest.raises(ValueError):
        timeline_figure(Timeline())


def test_timeline_downsampling_takes_an_odd_sample_count() -> None:
    """A `keep` add flushes the pending sample and its own, two at once, so the series can reach
    downsampling with an odd count (found by a long tracked CPU benchmark step)."""
    timeline = Timeline(samples_per_step=4, max_steps=2)
    timeline.begin_step(0, 1)
    zeros = dict.fromkeys(COMPONENTS, 0)
    for t in range(1, 200):
        total = 10_000 if t == 150 else t % 7
        timeline.add(t, "forward", zeros | {"other": total}, total, keep=t % 3 == 0)
    samples = timeline.samples
    assert 0 < len(samples) <= 9
    assert max(s.total for s in samples) == 10_000
    assert [s.t for s in samples] == sorted(s.t for s in samples)
