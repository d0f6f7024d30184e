"""A Dask cluster started the way users start one, for the tests and the benches: ``dask
scheduler`` and two ``dask worker tcp://HOST:PORT`` processes from the command line, on loopback.

Each worker runs in its own working directory with its own HOME (so its own
``~/.cache/tokenbridge``: it fetches every asset itself, as a worker on another machine would),
and gets the environment a user would export on that machine: the AWS variables of the test S3
server, and PYTHONPATH naming this checkout (the package a user's image would have installed).
`start` waits until both workers have joined; `stop` ends the three processes. `upload_model_dir`
puts a marked model or tokenizer directory in the store with no local copy left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.storage.seaweed import free_ports
from tokenbridge import paths, remote_models, urls

DASK = Path(sys.executable).with_name("dask")
START_TIMEOUT_S = 120.0


@dataclass
class DaskCluster:
    root: Path
    env: dict[str, str]  # what each process gets on top of a bare environment
    workers: int = 2
    procs: list[subprocess.Popen] = field(default_factory=list)
    address: str = ""

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen:
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "PYTHONPATH": str(paths.REPO_ROOT),
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            **self.env,
        }
        with open(home / "log", "ab") as log:
            return subprocess.Popen(args, cwd=home, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def start(self) -> DaskCluster:
        (port,) = free_ports(1)
        self.address = f"tcp://127.0.0.1:{port}"
        self.procs.append(self._spawn([str(DASK), "scheduler", "--host", "127.0.0.1",
                                       "--port", str(port), "--no-dashboard"], "scheduler"))  # fmt: skip
        for i in range(self.workers):
            self.procs.append(self._spawn([str(DASK), "worker", self.address, "--name", f"w{i}",
                                           "--nworkers", "1", "--nthreads", "1", "--no-dashboard",
                                           "--host", "127.0.0.1"], f"worker{i}"))  # fmt: skip
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        from distributed import Client

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            with (
                contextlib.suppress(OSError, TimeoutError),
                Client(self.address, timeout=5) as client,
            ):
                client.wait_for_workers(self.workers, timeout=deadline - time.monotonic())
                return
            time.sleep(0.25)
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in self.root.rglob("log")}
        raise RuntimeError(f"the Dask cluster at {self.address} did not start: {logs}")

    def worker_dirs(self) -> list[Path]:
        return [self.root / f"worker{i}" for i in range(self.workers)]

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def upload_model_dir(tmp_path, url: str, files: dict[str, Path]) -> str:
    """A model / tokenizer directory of `files` (name -> source) built under `tmp_path`,
    marked and uploaded to `url` (`tokenbridge.remote_models`), then deleted: the launch that
    follows has nothing of it on disk. Its local name is the URL's last part."""
    d = tmp_path / urls.name(url)
    d.mkdir(parents=True)
    for name, src in files.items():
        shutil.copyfile(src, d / name)
    remote_models.upload(d, url)
    shutil.rmtree(d)
    return url
