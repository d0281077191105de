"""Every test in this process is one rank, whatever the shell that started pytest says."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def single_rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests in this process are one rank, whatever the shell that started pytest says."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    # plans are ranked with the device class's constants, not a step-time calibration cached on this
    # machine by earlier runs (tests/planner/test_step_time_calibration.py points it at a directory)
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", "off")
