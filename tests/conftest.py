"""Shared fixtures: small real photos (cut from scikit-image's), the counting pipeline's call log.
Helpers the tests share live in tests/helpers/ (test files import them from there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.files import write_photos

@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """A folder of 24 small real photos."""
    folder = tmp_path / "photos"
    write_photos(folder, 24)
    return folder


@pytest.fixture
def call_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Path of the op-call log the counting pipeline appends to (in this process and children)."""
    path = tmp_path / "calls.log"
    monkeypatch.setenv("PRECACHE_CALL_LOG", str(path))
    return path
