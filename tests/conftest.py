"""Every test in this process is one rank, whatever the shell that started pytest says. `shared_traces`:
planner traces of the same job shared between the tests that use it. The tests listed in tests/slow.txt
(slow by measurement: scripts/slow_tests.py) are marked `slow`, and the test files run longest first (by
the seconds that file records), so the workers of scripts/test.sh finish together. A `gpu` test must
sit in a file scripts/gpu_check.sh finds (it collects those files alone)."""

from __future__ import annotations

import re
import signal
import warnings
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memtrain.planner import model_probe

SLOW = Path(__file__).with_name("slow.txt")
GPU_FILE = re.compile(r"mark\.gpu\b")  # how scripts/gpu_check.sh finds the files of the `gpu` tests (grep -E)


def _measured() -> tuple[set[str], dict[str, float]]:
    """(the slow tests, each test file's seconds) from tests/slow.txt."""
    slow, files = set(), {}
    for line in SLOW.read_text().splitlines():
        if line.strip()[:1] in ("", "#"):
            continue
        name, *seconds = line.split()
        if "::" in name:
            slow.add(name)
        else:
            files[name] = float(seconds[0])
    return slow, files


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches the processes the tests start, however pytest was started (in each xdist worker too).
    A test run started in the background (`cmd &` in a script, nohup) ignores SIGINT and every child
    inherits that; memtrain keeps an inherited SIG_IGN while it imports (as a shell's background job
    should), so the tests that send a child Ctrl-C timed out (test_signals: a run under `nohup ... &`).
    A Python handler here makes each child start with the default action, as a terminal's foreground job."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    """Before every other plugin (`-m` deselects by marker): the listed tests are marked `slow`. After them
    (pytest has grouped the tests by their fixtures): the longest files first, each file's tests in the
    order pytest gave them (a stable sort, so module fixtures are still set up once); a file not measured
    yet goes first, as it may be long."""
    listed, file_seconds = _measured()
    _mark_slow(config, items, listed)
    _check_gpu_files(items)
    yield
    items.sort(key=lambda item: -file_seconds.get(item.nodeid.split("::")[0], float("inf")))


def _mark_slow(config: pytest.Config, items: list[pytest.Item], listed: set[str]) -> None:
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    if any("::" in arg for arg in config.args):  # some tests of a file asked for: no check of the list
        return
    # Listed tests of a collected file that are gone (renamed: they would run in the fast tier until the
    # list is written again).
    collected = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in collected}
    stale = sorted(t for t in listed - collected if t.split("::")[0] in files)
    if stale:
        warnings.warn(
            pytest.PytestWarning(
                f"tests/slow.txt names {len(stale)} tests that are not collected (e.g. {stale[0]}); "
                "rewrite it with scripts/slow_tests.py"
            ),
            stacklevel=1,
        )


def _check_gpu_files(items: list[pytest.Item]) -> None:
    """scripts/gpu_check.sh runs `pytest -m gpu` on the test files whose text matches GPU_FILE, not on the
    whole suite (its collection cost 10 s of the step's 16): a `gpu` test elsewhere would never run."""
    files = {item.path for item in items if item.get_closest_marker("gpu") is not None}
    missed = sorted(
        str(f) for f in files if not (f.name.startswith("test_") and GPU_FILE.search(f.read_text()))
    )
    if missed:
        raise pytest.UsageError(
            f"{missed[0]} holds a `gpu` test that scripts/gpu_check.sh would not collect: mark it with "
            "`pytest.mark.gpu` in a file named test_*.py"
        )


@pytest.fixture(autouse=True)
def single_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests in this process are one rank, whatever the shell that started pytest says."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    # plans are ranked with the device class's constants, not a step-time calibration cached on this
    # machine by earlier runs (tests/planner/test_step_time_calibration.py points it at a directory)
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", "off")


@pytest.fixture(scope="session")
def trace_memo() -> dict[Hashable, Any]:
    """The traced sizes of every probe in this session that `shared_traces` let share them."""
    return {}


@pytest.fixture
def shared_traces(trace_memo: dict[Hashable, Any]) -> Iterator[None]:
    """The planner's traces are shared with earlier tests of this session that traced the same job
    (`model_probe.shared_traces`: keyed on the trainer's config, the recipe's model and data sections,
    the hook functions, the strategies and rows of the traced size, adapters, quantisation and threads).
    Tests that patch what a trace runs (a strategy's internals, torch) must not use it; the planner's
    tests use it (tests/planner/conftest.py), for they plan the same tiny models again and again,
    and so do two strategy modules (test_new_strategy.py, test_optimizer_step.py)."""
    with model_probe.shared_traces(trace_memo):
        yield
