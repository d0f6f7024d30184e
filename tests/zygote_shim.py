"""What torchrun starts as a rank when a test wants the rank forked from the zygote.

``torchrun ... tests/zygote_shim.py trainer/main.py ...``: this process (standard library only,
so it starts in milliseconds) hands its command, environment, working directory, stdout and
stderr to the zygote's shims' server (`tests.zygote._serve_shims`), which forks the rank from
the already-imported zygote. It then stands in for the rank towards torchrun: signals it
receives are passed on, its death (``kill -9``) kills the rank, and it exits as the rank did
(the same code, or the same signal).
"""

import json
import os
import signal
import socket
import sys


def main() -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ["TOKENBRIDGE_TEST_ZYGOTE"])
    req = {"cmd": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(req).encode()], [1, 2])

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
