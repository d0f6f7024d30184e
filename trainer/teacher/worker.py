"""The teacher worker process: loads a teacher next to a student rank and fills the ring's slots.

Why a process: the teacher's forward for microbatch i+1 overlaps the student's step on
microbatch i, the teacher may be sharded differently from the student (its own process group),
and a teacher that crashes or hangs must not take the student down silently. Per microbatch
only ``(seq, slot, shapes)`` travel over a pipe. This module knows only the ring, never the
channel (docs/parallelism.md, "The teacher worker").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers the reductions that send CUDA tensors/events as IPC handles

from trainer.parallel.cpus import child_env, openmp_env
from trainer.teacher.ring import (
    ChannelError,
    SlotRing,
    TeacherTimeoutError,
    TeacherWorkerError,
    TensorSpec,
)


@dataclass(frozen=True)
class TeacherGroup:
    """Rendezvous for the teachers' own process group (one entry per student rank)."""

    init_method: str  # e.g. "tcp://127.0.0.1:29510" or "file:///tmp/teachers.rdzv"
    world_size: int
    rank: int
    backend: str = "gloo"  # "nccl" for GPU teachers
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"TeacherGroup: rank {self.rank} not in [0, {self.world_size})")


@dataclass
class TeacherContext:
    """Where a teacher program runs: its device and (optionally) the teachers' process group."""

    device: torch.device
    group: Any = None  # torch.distributed.ProcessGroup of the teachers, or None
    rank: int = 0
    world_size: int = 1


class TeacherProgram(Protocol):
    """What a worker runs. Picklable and light until ``setup`` (called once, in the worker)."""

    def input_spec(self) -> dict[str, TensorSpec]: ...

    def output_spec(self) -> dict[str, TensorSpec]: ...

    def setup(self, ctx: TeacherContext) -> None: ...

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


# ---------------------------------------------------------------------------------------------
# Student side.


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is not responding"
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


class WorkerProcess:
    """The student's handle on one worker: spawn, talk, watch, stop (the channel's backend for
    ``mode="process"``; `trainer.teacher.channel.TeacherBackend` describes the methods)."""

    kind = "teacher worker"

    def __init__(self, proc, conn, *, device: torch.device, poll_s: float, events, on_mapped):
        self._proc, self._conn = proc, conn
        self._on_mapped = on_mapped  # the worker has mapped the ring: its name can go
        self.device, self.poll_s = device, poll_s
        self._free_events = events  # CUDA: recorded by the student when a slot may be written
        self._ready_events = None  # CUDA: recorded by the worker when a slot's outputs are done
        self.info: dict | None = None
        self._inbox: deque[tuple] = deque()  # messages `done` received before they were awaited

    @classmethod
    def start(
        cls,
        ring: SlotRing,
        program: TeacherProgram,
        *,
        device: torch.device,
        group: TeacherGroup | None,
        threads: int | None,
        poll_s: float,
    ) -> WorkerProcess:
        """Spawn the worker and send it the ring; it loads the teacher on its own (see
        ``wait_ready``). ``threads``: torch intra-op threads in the worker (None: torch's)."""
        events = None
        if device.type == "cuda":
            with torch.cuda.device(device):
                events = [torch.cuda.Event(interprocess=True) for _ in range(ring.layout.depth)]
        # spawn, not fork: the student may hold threads, CUDA contexts and process groups.
        ctx = torch.multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=worker_main,
            args=(child_conn, program, str(device), group),
            kwargs={"threads": threads, "parent_pid": os.getpid()},
            name=f"teacher-worker-{group.rank if group else 0}",
            daemon=True,  # killed by multiprocessing's atexit if the student forgets close()
        )
        # idle OpenMP threads of the worker sleep after a short spin instead of holding a core
        # the student needs (`trainer.parallel.cpus`): read when the worker imports torch
        with _sigint_ignored(), child_env(openmp_env()):
            proc.start()
        child_conn.close()
        worker = cls(
            proc,
            parent_conn,
            device=device,
            poll_s=poll_s,
            events=events,
            on_mapped=ring.mapped_elsewhere,
        )
        # The ring (and the CUDA events) travel as the first message, not as Process arguments:
        # the Process object keeps its arguments, and a CUDA ring referenced there would stay
        # allocated after close(). Pickled here, a CUDA tensor/event is sent as its IPC handle.
        try:
            parent_conn.send(("ring", ring.handle(), events))
        except OSError:
            raise worker._died("receiving the slot ring") from None
        return worker

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _died(self, what: str) -> TeacherWorkerError:
        self._proc.join(timeout=1.0)
        return TeacherWorkerError(
            f"teacher worker (pid {self.pid}) {_exit_text(self._proc.exitcode)} while {what}"
        )

    def _wait(self, timeout: float, what: str) -> tuple:
        if self._inbox:  # taken by `done` before anyone waited for it
            return self._inbox.popleft()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self._conn.poll(max(0.0, min(self.poll_s, left))):
                msg = self._recv(what)
                if msg is not None:
                    return msg
                continue
            if not self._proc.is_alive():
                if self._conn.poll(0):
                    continue  # it wrote a last message (its traceback) before exiting
                raise self._died(what)
            if left <= 0:
                raise TeacherTimeoutError(
                    f"teacher worker (pid {self.pid}) gave no answer in {timeout:.1f} s while "
                    f"{what}; it was killed (raise ChannelConfig.timeout_s if it is only slow)"
                )

    def _recv(self, what: str) -> tuple | None:
        """The next message of the worker (one is waiting), raised if it is an error; None for
        one the backend handles itself (the ring mapped)."""
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            raise self._died(what) from None
        if msg[0] == "mapped":
            self._on_mapped()
            return None
        if msg[0] == "error":
            _, phase, tb = msg
            last = tb.strip().splitlines()[-1] if tb.strip() else "no traceback"
            raise TeacherWorkerError(
                f"teacher worker (pid {self.pid}) failed while {phase}: {last}\n"
                f"its traceback:\n{tb}"
            )
        return msg

    def done(self, n: int) -> bool:
        """Have the oldest ``n`` microbatches in flight finished? Never waits: the messages
        waiting now are kept for ``wait_done`` in order."""
        while self._conn.poll(0):
            msg = self._recv("computing")
            if msg is not None:
                self._inbox.append(msg)
        return sum(m[0] == "done" for m in self._inbox) >= n

    def wait_ready(self, timeout: float) -> None:
        if self.info is not None:
            return
        msg = self._wait(timeout, "loading the teacher")
        if msg[0] != "ready":
            raise ChannelError(f"teacher worker protocol: expected 'ready', got {msg[0]!r}")
        self.info = msg[1]
        self._ready_events = self.info.pop("ready_events", None)

    def run(self, seq: int, slot: int, shapes: dict) -> None:
        if self._free_events is not None:
            # The worker's stream waits for everything the student queued on this slot so far
            # (its reads of the previous outputs, the copy of these inputs).
            self._free_events[slot].record(torch.cuda.current_stream(self.device))
        try:
            self._conn.send(("run", seq, slot, shapes))
        except OSError:
            raise self._died(f"receiving microbatch {seq}") from None

    def wait_done(self, seq: int, slot: int, timeout: float) -> tuple:
        msg = self._wait(timeout, f"computing microbatch {seq}")
        if msg[:3] != ("done", seq, slot):
            raise ChannelError(
                f"teacher worker protocol: expected done {seq}/{slot}, got {msg[:3]}"
            )
        if self._ready_events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready_events[slot])
        return msg[1:]

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=5.0)

    def stop(self) -> None:
        """Ask politely, then SIGTERM, then SIGKILL; always reap the process."""
        try:
            if self._proc.is_alive():
                with contextlib.suppress(OSError):
                    self._conn.send(("stop",))
                self._proc.join(timeout=5.0)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=2.0)
            self.kill()
        finally:
            self._conn.close()


@contextlib.contextmanager
def _sigint_ignored():
    """Start the worker with SIGINT ignored: a new Python keeps an inherited SIG_IGN, so a
    Ctrl-C while the worker is still importing (seconds) does not print a KeyboardInterrupt
    traceback from it; the student decides what Ctrl-C means. Main thread only (as is
    ``signal``); elsewhere the worker ignores SIGINT once ``worker_main`` runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


# ---------------------------------------------------------------------------------------------
# Worker side.


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            # 1 = PR_SET_PDEATHSIG. The "parent" is the *thread* that started the worker, so
            # channels are started from the main thread
            libc.prctl(1, int(signal.SIGKILL))
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(1)  # the student died before we could ask to follow it


def _thread_lock_for_progress_bars() -> None:
    # tqdm (transformers' "Loading weights" bar) creates a multiprocessing lock on first use: a
    # named semaphore registered with the resource tracker, which this process shares with the
    # student. A worker killed outright never unregisters it, and the tracker then warns about
    # a "leaked semaphore" when the student exits. One process needs only a thread lock.
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


# What torchrun / torch.distributed.elastic tell a student rank. A worker inherits the student's
# environment; left there, any env:// initialisation in the teacher (init_device_mesh with no
# group yet, say) would join the *student's* rendezvous as the student's rank.
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _scrub_launcher_env() -> None:
    for key in list(os.environ):
        if key in LAUNCHER_ENV or key.startswith("TORCHELASTIC_"):
            del os.environ[key]


def _join_group(group: TeacherGroup, device: torch.device) -> tuple[TeacherContext, float]:
    dist.init_process_group(
        group.backend,
        init_method=group.init_method,
        world_size=group.world_size,
        rank=group.rank,
        timeout=timedelta(seconds=group.timeout_s),
    )
    # A handshake proves the group works before the first microbatch depends on it.
    probe = torch.ones(1, device=device if group.backend == "nccl" else "cpu")
    dist.all_reduce(probe)
    ctx = TeacherContext(device, dist.group.WORLD, group.rank, group.world_size)
    return ctx, float(probe.item())


def worker_main(
    conn,
    program: TeacherProgram,
    device: str,
    group: TeacherGroup | None,
    *,
    threads: int | None,
    parent_pid: int,
) -> None:
    """Entry point of the worker process (spawned by ``WorkerProcess.start``); its first message
    is ``("ring", ring handle, CUDA events or None)``, answered with ``("mapped",)`` once the
    ring is mapped, then ``("ready", info)`` once the teacher is loaded."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    _scrub_launcher_env()
    _thread_lock_for_progress_bars()
    ring = None
    phase = "starting"
    try:
        if threads:
            torch.set_num_threads(threads)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        phase = "mapping the slot ring"
        try:
            _, ring_handle, events = conn.recv()
        except (EOFError, OSError):
            return  # the student is gone before it sent the ring
        ring = SlotRing.attach(ring_handle)
        conn.send(("mapped",))  # the student unlinks the segment's name now (ShmArena)
        ctx, handshake = TeacherContext(dev), None
        if group is not None:
            phase = f"joining the teacher group at {group.init_method}"
            ctx, handshake = _join_group(group, dev)
        phase = "loading the teacher"
        program.setup(ctx)
        ready = None
        if dev.type == "cuda":
            ready = [torch.cuda.Event(interprocess=True) for _ in range(ring.layout.depth)]
        info = {
            "pid": os.getpid(),
            "device": str(dev),
            "threads": torch.get_num_threads(),
            "group_rank": ctx.rank,
            "group_size": ctx.world_size,
            "group_handshake": handshake,
            "launcher_env": sorted(k for k in os.environ if k in LAUNCHER_ENV),
            "ready_events": ready,
        }
        conn.send(("ready", info))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the student is gone
            if msg[0] == "stop":
                return
            _, seq, slot, shapes = msg
            phase = f"computing microbatch {seq}"
            t0 = time.perf_counter()
            if events is not None:
                torch.cuda.current_stream().wait_event(events[slot])
            outs = program(ring.views(slot, "in", shapes))
            out_shapes = ring.write(slot, "out", outs, where=f"teacher output (seq={seq})")
            if ready is not None:
                ready[slot].record()
            conn.send(("done", seq, slot, out_shapes, time.perf_counter() - t0))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", phase, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if ring is not None:
            ring.close()
        if group is not None and dist.is_initialized():
            dist.destroy_process_group()
