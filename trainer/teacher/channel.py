"""The logit channel: a student rank's link to its teacher, over a ring of pre-allocated slots.

``submit`` copies a microbatch's teacher inputs into a free slot and starts the teacher on it;
``receive`` hands back the oldest one's outputs as zero-copy views of its slot; ``close`` stops
the teacher and frees the ring. The teacher sits behind one of two backends with the same
methods: its own process (`trainer.teacher.worker`), or an inline call for debugging. Lifetime,
failure and cleanup: docs/parallelism.md, "The teacher channel".
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from trainer.teacher.ring import ChannelError, SlotRing, plan_layout
from trainer.teacher.worker import TeacherContext, TeacherGroup, TeacherProgram, WorkerProcess


@dataclass(frozen=True)
class ChannelConfig:
    """How a student rank talks to its teacher.

    depth: slots in the ring (>= 2 lets the worker compute microbatch i+1 while the student uses
    microbatch i). timeout_s: longest wait for one microbatch's outputs before the worker is
    declared hung and killed; start_timeout_s: the same for loading the teacher. poll_s: how
    often the worker's liveness is checked while waiting. worker_threads: torch intra-op threads
    in the worker (None = torch's default; set it when student and worker share few cores).
    poison: fill a slot with NaN / -1 on release so a view kept past its lifetime shows up.
    """

    mode: str = "process"  # "process" | "inprocess"
    depth: int = 2
    timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    poll_s: float = 0.05
    worker_threads: int | None = None
    poison: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("process", "inprocess"):
            raise ValueError(
                f"ChannelConfig.mode must be 'process' or 'inprocess', got {self.mode!r}"
            )
        if self.depth < 1:
            raise ValueError(f"ChannelConfig.depth must be >= 1, got {self.depth}")
        for name in ("timeout_s", "start_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ChannelConfig.{name} must be > 0, got {getattr(self, name)}")


class TeacherBackend(Protocol):
    """What the channel asks of the teacher behind it (a worker process, or an inline call).

    ``run`` starts microbatch ``seq`` on the inputs in ``slot``; ``wait_done`` returns
    ``(seq, slot, output shapes, teacher seconds)`` once its outputs are in the slot; ``done(n)``
    says, without waiting, whether the oldest ``n`` in flight have finished. A backend
    raises on failure; the channel then calls ``kill`` and stays broken.
    """

    kind: str  # how errors name it: "teacher worker" or "in-process teacher"

    @property
    def pid(self) -> int | None: ...

    @property
    def info(self) -> dict | None: ...

    def wait_ready(self, timeout: float) -> None: ...

    def run(self, seq: int, slot: int, shapes: dict) -> None: ...

    def wait_done(self, seq: int, slot: int, timeout: float) -> tuple: ...

    def done(self, n: int) -> bool: ...

    def kill(self) -> None: ...

    def stop(self) -> None: ...


class InProcessTeacher:
    """The teacher called inline, on ``run``: one process, the teacher's exceptions as raised
    (with their tracebacks), nothing to start or stop. On a GPU its kernels go to a stream of
    their own: the feed submits a microbatch a step ahead, so they can run beside the student's
    instead of after them; ``wait_done`` makes the student's stream wait for them (an event,
    no host sync)."""

    kind = "in-process teacher"
    pid = None

    def __init__(self, ring: SlotRing, program: TeacherProgram, *, device: torch.device) -> None:
        program.setup(TeacherContext(device=device))
        self._ring, self._program, self._device = ring, program, device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._done: deque[tuple] = deque()  # (seq, slot, output shapes, seconds, CUDA event)

    @property
    def info(self) -> dict:
        return {"mode": "inprocess"}

    def wait_ready(self, timeout: float) -> None:
        return None

    def run(self, seq: int, slot: int, shapes: dict) -> None:
        t0 = time.perf_counter()
        event = None
        if self._stream is None:
            out_shapes = self._compute(seq, slot, shapes)
        else:
            # the inputs were copied into the slot on the student's stream
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                out_shapes = self._compute(seq, slot, shapes)
                event = torch.cuda.Event()
                event.record(self._stream)
        self._done.append((seq, slot, out_shapes, time.perf_counter() - t0, event))

    def _compute(self, seq: int, slot: int, shapes: dict) -> dict:
        # the program's own tensors are made and freed on this stream: the caching allocator
        # hands their blocks to no other stream before this one's work is done
        outs = self._program(self._ring.views(slot, "in", shapes))
        return self._ring.write(slot, "out", outs, where=f"teacher output (seq={seq})")

    def wait_done(self, seq: int, slot: int, timeout: float) -> tuple:
        *got, event = self._done.popleft()
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)
        return tuple(got)

    def done(self, n: int) -> bool:
        return True  # computed inside ``run``

    def kill(self) -> None:
        return None

    def stop(self) -> None:
        return None


@dataclass(eq=False)
class Received:
    """Outputs of one microbatch, viewing a ring slot. Valid until ``release()`` (or the end
    of its ``with`` block): the slot then goes back to the ring and the next microbatch
    overwrites it, so ``clone()`` anything that must outlive the block."""

    seq: int
    slot: int
    # seconds the teacher spent on this microbatch (forward + outputs); on CUDA the worker's
    # launch time, not GPU time
    teacher_s: float
    _outputs: dict[str, torch.Tensor] | None = field(repr=False)
    _channel: TeacherChannel = field(repr=False)

    @property
    def outputs(self) -> dict[str, torch.Tensor]:
        if self._outputs is None:
            raise ChannelError(
                f"microbatch {self.seq}: its slot was released; clone() what must outlive "
                "the `with channel.receive() as r:` block"
            )
        return self._outputs

    def release(self) -> None:
        if self._outputs is not None:
            self._outputs = None
            self._channel._release(self.slot)

    def __enter__(self) -> Received:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class TeacherChannel:
    """A student rank's link to its teacher: ``submit`` inputs, ``receive`` outputs, ``close``.

    ``program`` is a picklable ``TeacherProgram`` (`trainer.teacher.worker`): its specs size the
    ring; it is set up inside the worker (or here, in ``inprocess`` mode). ``device`` is the
    student's device; the worker uses the same one. ``group`` (optional) makes the workers of all
    ranks form their own process group, independent of the student's (see ``TeacherGroup``).
    Use as a context manager, or call ``close()``; an ``atexit`` hook and a SIGTERM handler close
    whatever is left open.
    """

    def __init__(
        self,
        program: TeacherProgram,
        *,
        device: torch.device | str = "cpu",
        config: ChannelConfig | None = None,
        group: TeacherGroup | None = None,
    ) -> None:
        self.config = cfg = config or ChannelConfig()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" alone: pin the current device, so the worker (which calls set_device with
            # it, and needs an index there) uses the same GPU as the student
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.layout = plan_layout(program.input_spec(), program.output_spec(), depth=cfg.depth)
        self._free: deque[int] = deque(range(cfg.depth))
        self._pending: deque[tuple[int, int]] = deque()  # (seq, slot) submitted, not received
        self._seq = 0
        self._broken: ChannelError | None = None
        self._closed = False
        inprocess = cfg.mode == "inprocess"
        # only a worker process maps the ring: in-process it stays a plain tensor
        self.ring = SlotRing.create(self.layout, device=self.device, shared=not inprocess)
        try:
            self._backend: TeacherBackend = (
                InProcessTeacher(self.ring, program, device=self.device)
                if inprocess
                else WorkerProcess.start(
                    self.ring,
                    program,
                    device=self.device,
                    group=group,
                    threads=cfg.worker_threads,
                    poll_s=cfg.poll_s,
                )
            )
        except BaseException:
            self.ring.close()
            raise
        _register(self)

    # -- introspection (tests, metrics) --
    @property
    def worker_pid(self) -> int | None:
        return self._backend.pid

    @property
    def shm_name(self) -> str | None:
        return self.ring.shm_name

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def info(self) -> dict | None:
        """What the worker reported once ready (pid, device, group rank/size...)."""
        return self._backend.info

    def wait_ready(self, timeout: float | None = None) -> dict | None:
        """Block until the worker has loaded the teacher (``receive`` does this itself)."""
        self._check()
        timeout = timeout or self.config.start_timeout_s
        self._guard("loading the teacher", self._backend.wait_ready, timeout)
        return self.info

    def submit(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Copy ``inputs`` into a free slot and start the teacher on it; returns its seq."""
        self._check()
        if not self._free:
            raise ChannelError(
                f"no free slot: all {self.config.depth} are submitted or held; receive() and "
                "release one before submitting more"
            )
        slot = self._free[0]
        shapes = self.ring.write(slot, "in", inputs, where=f"submit(seq={self._seq})")
        self._free.popleft()
        seq, self._seq = self._seq, self._seq + 1
        self._pending.append((seq, slot))
        self._guard(f"microbatch {seq}", self._backend.run, seq, slot, shapes)
        return seq

    def done(self) -> bool:
        """Are the outputs of every submitted microbatch there (``receive`` would not wait)?
        Never waits; a failed teacher raises here as in ``receive``."""
        self._check()
        if not self._pending:
            return True
        return self._guard("a microbatch", self._backend.done, len(self._pending))

    def receive(self, timeout: float | None = None) -> Received:
        """Outputs of the oldest submitted microbatch (waits; bounded by ``timeout``)."""
        self._check()
        if not self._pending:
            raise ChannelError("receive() with nothing submitted")
        seq, slot = self._pending[0]
        self._guard("loading the teacher", self._backend.wait_ready, self.config.start_timeout_s)
        wait = self._backend.wait_done
        got = self._guard(f"microbatch {seq}", wait, seq, slot, timeout or self.config.timeout_s)
        _, _, shapes, seconds = got
        self._pending.popleft()
        return Received(seq, slot, seconds, self.ring.views(slot, "out", shapes), self)

    def _release(self, slot: int) -> None:
        if self._closed:
            return
        if self.config.poison:
            self.ring.poison(slot, "out")
        self._free.append(slot)

    def _check(self) -> None:
        if self._closed:
            raise ChannelError("the channel is closed")
        if self._broken is not None:
            raise ChannelError(f"the channel is broken: {self._broken}") from self._broken

    def _guard(self, what: str, fn, *args):
        """Run a backend call; on failure remember the error and kill the teacher (no orphan):
        whatever state it is in, no later microbatch may depend on it."""
        try:
            return fn(*args)
        except Exception as e:
            failed = f"the {self._backend.kind} failed on {what}"
            self._broken = e if isinstance(e, ChannelError) else ChannelError(failed)
            self._backend.kill()
            raise

    def close(self) -> None:
        """Stop the worker (stop message, then SIGTERM, then SIGKILL) and free the ring."""
        if self._closed:
            return
        self._closed = True
        try:
            self._backend.stop()
        finally:
            self.ring.close()
            _OPEN.discard(self)

    def __enter__(self) -> TeacherChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def starting_together(channels: list[TeacherChannel]) -> Iterator[list[TeacherChannel]]:
    """Start several channels as one: the caller appends them to ``channels`` in the block, at
    its end every one is waited ready; on any failure (building one, or a teacher that does
    not come up) all of them are closed and the error goes on."""
    try:
        yield channels
        for ch in channels:
            ch.wait_ready()
    except BaseException:
        for ch in channels:
            ch.close()
        raise


# ---------------------------------------------------------------------------------------------
# Cleanup on exit, error or signal: close every channel still open.

_OPEN: set[TeacherChannel] = set()
_HOOKED = False


def close_all() -> None:
    """Close every open channel of this process (atexit; also safe to call by hand)."""
    for ch in list(_OPEN):
        ch.close()


def _sigterm_to_exit(signum: int, frame: object) -> None:
    # The default SIGTERM action kills the process without running finally blocks or atexit;
    # as an exception, the student's cleanup (and ours, via atexit) runs.
    raise SystemExit(128 + signum)


def _register(ch: TeacherChannel) -> None:
    global _HOOKED
    _OPEN.add(ch)
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(close_all)
    # SIGINT already raises KeyboardInterrupt; only a default SIGTERM needs turning into one.
    is_main = threading.current_thread() is threading.main_thread()
    if is_main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_to_exit)
