"""The staged Hugging Face cache of tests/hf_cache.py as a fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

import hf_cache


@pytest.fixture
def staged_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return hf_cache.stage(tmp_path, monkeypatch)
