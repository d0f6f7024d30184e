"""What torchrun starts as a rank, or a rank as its teacher worker, when a test wants the
process forked from the zygote.

``torchrun ... tests/zygote_shim.py trainer/main.py ...``: this process (standard library only,
so it starts in milliseconds) hands its command, environment, working directory, stdout and
stderr to the zygote's shims' server (`tests.zygote._serve_shims`), which forks the rank from
the already-imported zygote. ``python -S tests/zygote_shim.py -c "...spawn_main(tracker_fd=T,
pipe_handle=P)" --multiprocessing-fork``: a process that multiprocessing's "spawn" starts (a
teacher worker: `tests.zygote.spawn_through_shims`), handed over with every fd spawn passed it;
the forked worker then runs what the spawned interpreter would have run, without its ~5 s of
imports. Either way this process then stands in for the forked one towards its parent: signals
it receives are passed on, its death (``kill -9``, or its parent's: PR_SET_PDEATHSIG) kills it,
and it exits as the forked process did (the same code, or the same signal).
"""

import ctypes
import json
import os
import signal
import socket
import sys


def _request() -> tuple[dict, list[int]]:
    req = {"env": dict(os.environ), "cwd": os.getcwd()}
    if sys.argv[1:2] == ["-c"] and "spawn_main" in sys.argv[2]:
        parent = os.getppid()
        # a teacher worker dies with its student (PR_SET_PDEATHSIG): so does its stand-in
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        if os.getppid() != parent:
            sys.exit(1)  # the parent died before the line above
        # every fd spawn passed on (stdio, the resource tracker's, the pipe the process object
        # comes through, the fds that object names by number): the worker gets them all at the
        # same numbers. The forked worker's parent, as its own code checks it, is our parent.
        fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
        fds = [fd for fd in fds if _is_open(fd)]  # not the listing's own
        return {**req, "spawn": {"ppid": parent, "fds": fds, "argv": sys.argv[1:]}}, fds
    return {**req, "cmd": sys.argv[1:]}, [1, 2]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def main() -> None:
    req, fds = _request()  # before the socket: not one of the fds passed on
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ["TOKENBRIDGE_TEST_ZYGOTE"])
    socket.send_fds(sock, [json.dumps(req).encode()], fds)

    def forward(sig, _frame):
        sock.send(str(sig).encode())

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    json.loads(sock.recv(4096))  # the rank's pid: it runs
    reply = sock.recv(4096)
    code = json.loads(reply)["rc"] if reply else 1
    if code < 0:  # killed by a signal: end the same way, so torchrun reports the same failure
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
