"""Which rank of a run is gone when a collective fails: a heartbeat in the rendezvous store.

A rank killed outright (``kill -9``, a node lost) says nothing, and its peers meet only a closed
connection or the process group's timeout, neither naming it. So under torchrun each rank keeps
a heartbeat in the store (`start`) and notes when it ends on its own (`end`); a rank whose
collective failed (`explain`) names each rank whose beat stopped with no end noted
(`LostRankError`; docs/parallelism.md, "Several nodes").
"""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

INTERVAL_S = 1.0  # between two beats of a rank
WAIT_BEATS = 3  # how many beats a rank must miss to be called gone
# what a failed collective says when its peer's process is gone, or when it timed out
SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
         "remote process exited", "Timed out", "timed out")  # fmt: skip


class LostRankError(Exception):
    """A peer rank stopped without a word: killed, or its node lost (named in the message)."""


class _Heartbeat:
    def __init__(self, *, rank: int, world: int, host: str, port: int):
        self.rank, self.world = rank, world
        self.where = f"{host}:{port}"
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"tokenbridge/liveness/{run}/{attempt}/"
        self.store = self._connect(host, port)
        self.lock = threading.Lock()
        who = {
            "node": os.environ.get("GROUP_RANK", "?"),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self.store.set(self._key("who", rank), json.dumps(who))
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="tokenbridge-heartbeat", daemon=True)
        self.thread.start()

    @staticmethod
    def _connect(host: str, port: int) -> dist.TCPStore:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))

    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}{what}/{rank}"

    def _beat(self) -> None:
        while not self.stopped.wait(INTERVAL_S):
            try:
                with self.lock:
                    self.store.add(self._key("beat", self.rank), 1)
            except Exception:  # the store is gone: `explain` says so when a collective fails
                return

    def end(self) -> None:
        self.stopped.set()
        # joined, not left to die with the interpreter inside a store call (C++ aborts then)
        self.thread.join(timeout=10 * INTERVAL_S)
        try:
            with self.lock:
                self.store.set(self._key("end", self.rank), "1")
        except Exception:
            pass

    def lost(self) -> list[str]:
        """The ranks whose heartbeat stopped with no end noted, each as "rank R (node, pid)"."""
        host, port = self.where.rsplit(":", 1)
        store = self._connect(host, int(port))
        ranks = [r for r in range(self.world) if r != self.rank]
        before = {r: store.add(self._key("beat", r), 0) for r in ranks}
        time.sleep(WAIT_BEATS * INTERVAL_S)
        gone = []
        for r in ranks:
            if store.add(self._key("beat", r), 0) != before[r]:
                continue
            if store.check([self._key("end", r)]):
                continue
            known = store.check([self._key("who", r)])
            who = json.loads(store.get(self._key("who", r))) if known else {}
            gone.append(
                f"rank {r} (node {who.get('node', '?')}, pid {who.get('pid', '?')} on "
                f"{who.get('host', '?')})"
            )
        return gone


_heart: _Heartbeat | None = None


def start(*, rank: int, world: int) -> None:
    """Begin this rank's heartbeat (under torchrun, in a world of several ranks; else nothing):
    who it is (node, host, pid) noted in the store, then a counter bumped every `INTERVAL_S` by
    a daemon thread on a store connection of its own."""
    global _heart
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world < 2 or not host or not port or _heart is not None:
        return
    try:
        _heart = _Heartbeat(rank=rank, world=world, host=host, port=int(port))
    except Exception:  # no store to beat in: failures are said as before
        _heart = None
        return
    atexit.register(end)  # a process that exits (not killed) ends on its own


def end() -> None:
    """This rank ends on its own: a peer that sees it go is not to name it."""
    global _heart
    if _heart is not None:
        _heart.end()
        _heart = None


def explain(e: BaseException) -> BaseException:
    """`e` itself, or a `LostRankError` naming the peers that are gone when `e` is a collective
    that failed because they went without a word."""
    heart = _heart
    if heart is None or not any(s in str(e) for s in SIGNS):
        return e
    said = (str(e).strip().splitlines() or [type(e).__name__])[0]
    said = re.sub(r"^\[[^\]]*\]\s*", "", said).split(". This is typically")[0]  # gloo's source
    try:
        gone = heart.lost()
    except Exception:
        return LostRankError(
            f"the rendezvous store at {heart.where} stopped answering (the node that hosts it "
            f"is gone, with its ranks); this rank's collective said: {said}"
        )
    if not gone:
        return e
    return LostRankError(
        f"{', '.join(gone)} stopped without a word (killed, or its node lost): no heartbeat "
        f"for {WAIT_BEATS * INTERVAL_S:.0f} s; this rank's collective said: {said}"
    )
