"""A process that has imported the trainer once and forks a fresh child for each one-process run.

A trainer process spends ~10 s importing torch, transformers and the trainer before its first
step, more than a tiny test run's steps. The end-to-end tests launch a couple of dozen such
processes; `Zygote.run(["trainer/main.py", ...])` does what ``python trainer/main.py ...`` does
(``["-m", "module", ...]`` too), in a child forked from this already-imported process: a new
process per run as before (its own pid, memory, exit code, stdout and stderr), without the
import. The child is forked while this process has no thread of its own. What a run starts with
multiprocessing's "spawn" (its teacher workers) is forked from here too, through a stand-in
process (`spawn_through_shims`): the ~5 s of imports of a fresh worker are gone as well, and a
run that sets `REAL_SPAWN` spawns fresh interpreters as a user's run does. Multi-process runs
stay under torchrun.

Protocol (this module's ``main``): one JSON request per line on stdin, ``{"cmd", "env", "out"}``;
one line back on the saved stdout when the child starts (its pid) and one when it ends (its
exit code); the child's fds 1 and 2 go to ``out/stdout`` and ``out/stderr``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# as bench.common.run_trainer sets them for a trainer process; OpenMP's wait policy as
# trainer.main sets it before torch loads (trainer.parallel.cpus.openmp_env)
BASE_ENV = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
SHIM_SOCKET = "TOKENBRIDGE_TEST_ZYGOTE"  # where `tests.zygote_shim` finds the shims' server
# put before ``trainer/main.py`` in a torchrun command line (with `Zygote.shim_env` in the
# agent's environment) to have each rank forked from the zygote: torchrun, its rendezvous, its
# agents, signals and exit codes stay real; only the rank's ~10 s of imports are gone
SHIM = Path(__file__).with_name("zygote_shim.py")
# set in a run's environment: its spawns start fresh interpreters (their imports, as any run's)
REAL_SPAWN = "TOKENBRIDGE_TEST_REAL_SPAWN"
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
    # imported on first use: pandas by pyarrow's first to_numpy of a shard column (~0.13 s),
    # Hydra by the config's compose, s3fs by the runs that read or write an object store
    "pandas",
    "pyarrow.pandas_compat",
    "hydra",
    "hydra.core.override_parser.overrides_parser",
    "s3fs",
)


def _child(cmd: list[str], out: Path) -> int:
    """In the forked child: ``python *cmd`` as the interpreter would run it; the exit code."""
    # appended: the ranks of one run share the files, as torchrun's output
    with open(out / "stdout", "ab") as o, open(out / "stderr", "ab") as e:
        return _run(cmd, o.fileno(), e.fileno())


def _run(cmd: list[str], stdout: int, stderr: int) -> int:
    """``python *cmd`` in this (forked) process, its fds 1 and 2 on `stdout` and `stderr`."""
    os.setpgid(0, 0)  # its own group: a timeout ends the run and its workers together
    spawn_through_shims()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout, 1), os.dup2(stderr, 2)

    def main() -> None:
        if cmd[0] == "-m":
            sys.argv = [cmd[1], *cmd[2:]]
            runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(cmd)
            sys.path[0] = str(Path(cmd[0]).resolve().parent)
            runpy.run_path(cmd[0], run_name="__main__")

    return _exit_code(main)


def _exit_code(main) -> int:
    """`main()` as the interpreter runs a program: its exit code (SystemExit's, printing a
    message one carries; 1 after printing an exception's traceback)."""
    try:
        main()
    except SystemExit as e:
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


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


def spawn_through_shims() -> None:
    """In a process forked from the zygote: what multiprocessing's "spawn" starts from here (a
    teacher worker) is forked from the zygote too, through `tests.zygote_shim` (the process
    spawn starts: it stands in for the worker), not a fresh interpreter that imports torch and
    transformers again. Other spawns (the resource tracker) are left as they are."""
    from multiprocessing import spawn

    plain = getattr(spawn.get_command_line, "plain", spawn.get_command_line)

    def command_line(**kwds) -> list[str]:  # [python, flags, "-c", prog, "--multiprocessing-fork"]
        return [sys.executable, "-S", str(SHIM), *plain(**kwds)[-3:]]

    if os.environ.get(SHIM_SOCKET) and not os.environ.get(REAL_SPAWN):
        command_line.plain = plain
        spawn.get_command_line = command_line


def _spawned(req: dict, fds: list[int]) -> int:
    """In the forked child: what ``python -c "spawn_main(...)"`` runs, on the fds its stand-in
    passed, each at the number it had there (the pickled process object names them so)."""
    from multiprocessing import spawn

    def main() -> None:
        os.setpgid(0, 0)
        numbers = req["spawn"]["fds"]
        if len(fds) != len(numbers):
            raise RuntimeError(f"the stand-in passed {len(numbers)} fds, {len(fds)} came")
        # first out of the way of the numbers they must take (the server has no stdin, so a
        # passed fd may have landed on one of them), then each onto its number in the stand-in
        above = max(*fds, *numbers) + 1
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
        for fd in fds:
            os.close(fd)
        for fd, number in zip(moved, numbers, strict=True):
            os.dup2(fd, number)
            os.close(fd)
        ppid = req["spawn"]["ppid"]
        os.getppid = lambda: ppid  # the student the stand-in belongs to, as the worker checks it
        sys.argv = [sys.executable, "--multiprocessing-fork"]
        kw = dict(re.findall(r"(tracker_fd|pipe_handle)=(\d+)", req["spawn"]["argv"][1]))
        spawn.spawn_main(tracker_fd=int(kw["tracker_fd"]), pipe_handle=int(kw["pipe_handle"]))

    return _exit_code(main)


def _shim_rank(conn: socket.socket, listening: list[int]) -> int:
    """Fork the rank a shim asks for (`tests.zygote_shim`): its command, its whole environment
    and working directory, its stdout and stderr (the fds the shim passed); the rank's pid. Or
    the spawned process it stands in for (``"spawn"``: `_spawned`)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 256)
    req = json.loads(data)
    pid = os.fork()
    if pid == 0:
        for fd in listening:
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        code = _spawned(req, fds) if "spawn" in req else _run(req["cmd"], *fds)
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid


def _serve_shims(path: str, alive: int) -> None:
    """The shims' server, forked from the zygote once it has imported everything: each
    connection forks one rank (torchrun's agents start the shims: `Zygote.shim`); a signal the
    shim receives is passed on to its rank, the shim's end kills it (``kill -9`` of a node's
    processes kills its ranks), and the rank's exit code goes back to the shim. Ends when the
    zygote does (`alive` closes). The ranks' pids are written to ``<path>.ranks/<shim pid>``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    ranks_dir = Path(path + ".ranks")
    ranks_dir.mkdir()
    shims: dict[int, socket.socket] = {}  # rank pid -> its shim's connection
    while True:
        ready, _, _ = select.select([listener, alive, *shims.values()], [], [], 0.2)
        for r in ready:
            if r is alive:
                for pid in shims:
                    _signal(pid, signal.SIGKILL)
                os._exit(0)
            if r is listener:
                conn, _ = listener.accept()
                shim_pid = struct.unpack("3i", conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]  # fmt: skip
                open_fds = [listener.fileno(), alive, conn.fileno(),
                            *(c.fileno() for c in shims.values())]  # fmt: skip
                pid = _shim_rank(conn, open_fds)
                (ranks_dir / str(shim_pid)).write_text(str(pid))
                shims[pid] = conn
                conn.send(json.dumps({"pid": pid}).encode())
                continue
            pid = next(p for p, c in shims.items() if c is r)
            msg = r.recv(64)
            # a signal the shim caught, or its end (killed): the rank follows
            _signal(pid, int(msg) if msg else signal.SIGKILL)
        while shims:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = shims.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())
                conn.close()


def _start_shim_server(path: str, replies: int) -> None:
    """Fork `_serve_shims` (its own process: the zygote itself stays single-threaded and
    serves its stdin; neither starts a thread, so both can fork)."""
    alive_r, alive_w = os.pipe()
    if os.fork() == 0:
        os.close(alive_w), os.close(replies), os.close(0)
        _serve_shims(path, alive_r)
    os.close(alive_r)  # alive_w stays open in the zygote until it exits


def main() -> None:
    replies = os.dup(1)  # the protocol's; the process's own prints go to stderr
    os.dup2(2, 1)
    from trainer.parallel.cpus import openmp_env

    os.environ.update({**BASE_ENV, **openmp_env()})
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # Numba's first use in a process (its CPU target, then the tokenizer kernel's cache): ~1 s
    # that every run would pay again when it loads its first tokenizer; and the two real
    # tokenizers themselves, which `load_tokenizer` keeps in memory by file and mtime (Gemma
    # 3's 262k vocabulary: ~3 s of CPU in each run whose teacher or student reads it)
    from tokenbridge import paths
    from tokenbridge.tokenizers import load_tokenizer

    for model_dir in (paths.student_dir(), paths.teacher_dir()):
        load_tokenizer(model_dir).encode("warm")
    sys.stdout.flush(), sys.stderr.flush()
    if os.environ.get(SHIM_SOCKET):
        _start_shim_server(os.environ[SHIM_SOCKET], replies)
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
            env={**os.environ, **BASE_ENV, SHIM_SOCKET: str(self.tmp / "shims")},
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

    def shim_env(self) -> dict[str, str]:
        return {SHIM_SOCKET: str(self.tmp / "shims")}

    def ranks_of(self, pids) -> set[int]:
        """The ranks forked for those of `pids` that are shims (a node's processes, to kill)."""
        found = set()
        for pid in pids:
            path = self.tmp / "shims.ranks" / str(pid)
            if path.is_file():
                found.add(int(path.read_text()))
        return found

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main()
