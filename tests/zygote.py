"""A process that has imported the trainer once and forks a fresh child for each one-process run.

A trainer process spends ~10 s importing torch, transformers and the trainer before its first
step, more than a tiny test run's steps. The end-to-end tests launch a couple of dozen such
processes; `Zygote.run(["trainer/main.py", ...])` does what ``python trainer/main.py ...`` does
(``["-m", "module", ...]`` too), in a child forked from this already-imported process: a new
process per run as before (its own pid, memory, exit code, stdout and stderr), without the
import. The child is forked while this process has no thread of its own, and a run's teacher
workers are spawned by it as in any run. Multi-process runs stay under torchrun.

Protocol (this module's ``main``): one JSON request per line on stdin, ``{"cmd", "env", "out"}``;
one line back on the saved stdout when the child starts (its pid) and one when it ends (its
exit code); the child's fds 1 and 2 go to ``out/stdout`` and ``out/stderr``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# as bench.common.run_trainer sets them for a trainer process; OpenMP's wait policy as
# trainer.main sets it before torch loads (trainer.parallel.cpus.openmp_env)
BASE_ENV = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
PRELOAD = (
    "trainer.main",
    "trainer.config.compose",
    "trainer.preflight",
    "trainer.loop",
    "trainer.onpolicy.side",
    "trainer.teacher.worker",
    "trainer.eval.runner",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gemma3.modeling_gemma3",
    "trainer.report.build",  # the run report every run ends with: matplotlib's Agg canvas
    "matplotlib.backends.backend_agg",
    "matplotlib.figure",
    "matplotlib.colors",
)


def _child(cmd: list[str], out: Path) -> int:
    """In the forked child: ``python *cmd`` as the interpreter would run it; the exit code."""
    os.setpgid(0, 0)  # its own group: a timeout ends the run and its workers together
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    # appended: the ranks of one run share the files, as torchrun's output
    with open(out / "stdout", "ab") as o, open(out / "stderr", "ab") as e:
        os.dup2(o.fileno(), 1), os.dup2(e.fileno(), 2)
    try:
        if cmd[0] == "-m":
            sys.argv = [cmd[1], *cmd[2:]]
            runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(cmd)
            sys.path[0] = str(Path(cmd[0]).resolve().parent)
            runpy.run_path(cmd[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    return code


def _fork(req: dict, replies: int, env: dict, *, store: int | None = None) -> int:
    """A child running ``req``'s command with `env` added; its pid (the parent's side)."""
    pid = os.fork()
    if pid == 0:
        os.close(replies)
        if store is not None:
            os.close(store)
        os.environ.update(env)
        os.chdir(req["cwd"])
        code = _child(req["cmd"], Path(req["out"]))
        try:
            atexit._run_exitfuncs()  # what interpreter exit runs: workers, shared memory
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    return pid


def _store(replies: int) -> tuple[int, int, int]:
    """A child holding the rendezvous store, as torchrun's agent does for its ranks (forked
    apart: the store's server threads must not be in the process the ranks are forked from);
    its pid, port and the pipe it waits on (closing it ends the child)."""
    port_r, port_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(replies), os.close(port_r), os.close(stop_w)
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.write(port_w, f"{store.port}\n".encode())
        os.read(stop_r, 1)  # until the ranks are done
        os._exit(0)
    os.close(port_w), os.close(stop_r)
    port = int(os.read(port_r, 64).decode().strip())
    os.close(port_r)
    return pid, port, stop_w


def _rank_env(rank: int, world: int, port: int, run: int) -> dict[str, str]:
    """What torchrun --standalone sets for each rank of one node."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": f"zygote-{run}",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    }  # fmt: skip


def _signal(pid: int, sig: int) -> None:
    """`sig` to the child's process group (its workers too), or the child if it has none yet."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_ranks(pids: list[int]) -> list[int]:
    """Exit codes of `pids`; once one fails, the others are stopped (SIGTERM), as torchrun does."""
    codes, left = {}, set(pids)
    while left:
        pid, status = os.waitpid(-1, 0)
        if pid not in left:
            continue
        left.discard(pid)
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:
            for other in left:
                _signal(other, signal.SIGTERM)
    return [codes[pid] for pid in pids]


def _serve(requests, replies: int) -> None:
    for run, line in enumerate(requests):
        req = json.loads(line)
        nproc = int(req.get("nproc", 1))
        sys.stdout.flush(), sys.stderr.flush()
        if nproc == 1:
            store, pids = None, [_fork(req, replies, req["env"])]
        else:
            store = _store(replies)
            pids = [_fork(req, replies, {**req["env"], **_rank_env(r, nproc, store[1], run)},
                          store=store[2]) for r in range(nproc)]  # fmt: skip
        os.write(replies, (json.dumps({"pids": pids}) + "\n").encode())
        codes = _wait_ranks(pids)
        if store is not None:
            os.close(store[2])
            with contextlib.suppress(ChildProcessError):  # reaped above: it ended on its own
                os.waitpid(store[0], 0)
        code = next((c for c in codes if c != 0), 0)
        os.write(replies, (json.dumps({"rc": code}) + "\n").encode())


def main() -> None:
    replies = os.dup(1)  # the protocol's; the process's own prints go to stderr
    os.dup2(2, 1)
    from trainer.parallel.cpus import openmp_env

    os.environ.update({**BASE_ENV, **openmp_env()})
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # Numba's first use in a process (its CPU target, then the tokenizer kernel's cache): ~1 s
    # that every run would pay again when it loads its first tokenizer
    from tokenbridge import paths
    from tokenbridge.tokenizers import load_tokenizer

    load_tokenizer(paths.student_dir()).encode("warm")
    os.write(replies, b'{"ready": true}\n')
    _serve(sys.stdin, replies)


class Zygote:
    """The test side: start the zygote once, then `run` commands through it."""

    def __init__(self, cwd: str | os.PathLike) -> None:
        self.cwd = Path(cwd)
        self.tmp = Path(tempfile.mkdtemp(prefix="zygote-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=self.cwd,
            env={**os.environ, **BASE_ENV},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._reply(600)
        self.count = 0

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the zygote gave no answer in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        assert line, f"the zygote ended (exit {self.proc.wait()})"
        return json.loads(line)

    def run(
        self,
        cmd: list[str],
        *,
        nproc: int = 1,
        env: dict | None = None,
        cwd: str | os.PathLike | None = None,
        timeout: float = 600,
    ) -> subprocess.CompletedProcess:
        """``python *cmd`` in `cwd` (default: the zygote's), forked from the zygote (``nproc``
        ranks of one node, with torchrun's environment, when above 1); its result."""
        self.count += 1
        out = self.tmp / f"run-{self.count}"
        out.mkdir()
        req = {"cmd": list(cmd), "nproc": nproc, "env": {**BASE_ENV, **(env or {})},
               "cwd": str(cwd or self.cwd), "out": str(out)}  # fmt: skip
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        pids = self._reply(60)["pids"]
        try:
            code = self._reply(timeout)["rc"]
        except TimeoutError:
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            self._reply(60)
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        return subprocess.CompletedProcess(
            [sys.executable, *cmd],
            code,
            (out / "stdout").read_text(errors="replace"),
            (out / "stderr").read_text(errors="replace"),
        )

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main()
