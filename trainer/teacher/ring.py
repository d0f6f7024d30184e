"""The slot ring: pre-allocated memory that carries a teacher's outputs to a student rank.

A teacher's outputs for one microbatch are large (top-k, columns, log-probs over B x T) and
pickling them through a pipe costs seconds at scale; here the student and its teacher share one
buffer allocated once (a shared-memory segment on CPU, one CUDA allocation shared by IPC handle
on a GPU), and only a few integers travel per microbatch. The base of the package: the worker,
the channel and the teacher program import it, and it imports none of them.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import torch

ALIGN = 256  # byte alignment of every tensor in a slot: any dtype, and CUDA's preferred 256
SHM_PREFIX = "tokenbridge_"


class ChannelError(RuntimeError):
    """Misuse of the channel, or a failure of the teacher behind it."""


class TeacherWorkerError(ChannelError):
    """The teacher worker died or raised; the message carries its exit status or traceback."""


class TeacherTimeoutError(ChannelError, TimeoutError):
    """The teacher worker gave no answer within the configured time (it was killed)."""


@dataclass(frozen=True)
class TensorSpec:
    """Maximum shape and dtype of one named tensor of a slot."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 1 for s in self.shape):
            raise ValueError(f"TensorSpec shape must be positive, got {self.shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"TensorSpec dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


Spec = Mapping[str, TensorSpec]


# ---------------------------------------------------------------------------------------------
# Layout: pure arithmetic over the specs.


@dataclass(frozen=True)
class SlotLayout:
    """Where each named tensor of each part lives inside a slot (byte offsets)."""

    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    depth: int
    offsets: dict[tuple[str, str], int]  # (part, name) -> byte offset inside a slot
    slot_nbytes: int

    @property
    def total_nbytes(self) -> int:
        return self.slot_nbytes * self.depth

    def spec(self, part: str) -> dict[str, TensorSpec]:
        return self.inputs if part == "in" else self.outputs


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def plan_layout(inputs: Spec, outputs: Spec, *, depth: int, align: int = ALIGN) -> SlotLayout:
    """Lay the input and output tensors of one slot end to end, each aligned to ``align``."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if not outputs:
        raise ValueError("the output spec is empty: a teacher must return at least one tensor")
    offsets: dict[tuple[str, str], int] = {}
    cursor = 0
    for part, spec in (("in", inputs), ("out", outputs)):
        for name, ts in spec.items():
            offsets[(part, name)] = cursor
            cursor = _round_up(cursor + ts.nbytes, align)
    return SlotLayout(dict(inputs), dict(outputs), depth, offsets, max(cursor, align))


def check_shapes(spec: Spec, tensors: Mapping[str, torch.Tensor], *, where: str) -> dict:
    """Validate tensors against a spec; return name -> actual shape. Errors name the field."""
    missing, extra = set(spec) - set(tensors), set(tensors) - set(spec)
    if missing or extra:
        raise ChannelError(
            f"{where}: tensor names differ from the spec: missing {sorted(missing)}, "
            f"unexpected {sorted(extra)} (spec has {sorted(spec)})"
        )
    shapes = {}
    for name, ts in spec.items():
        t = tensors[name]
        if t.dtype != ts.dtype:
            raise ChannelError(f"{where}: {name!r} has dtype {t.dtype}, the spec says {ts.dtype}")
        if t.dim() != len(ts.shape) or any(a > m for a, m in zip(t.shape, ts.shape)):
            raise ChannelError(
                f"{where}: {name!r} has shape {tuple(t.shape)}, the spec allows at most "
                f"{ts.shape} (same number of dims)"
            )
        shapes[name] = tuple(t.shape)
    return shapes


# ---------------------------------------------------------------------------------------------
# Arenas: one flat uint8 buffer holding every slot.


class ShmArena:
    """A POSIX shared-memory segment viewed as a uint8 tensor (CPU, cross-process).

    The creator names the segment and registers it with Python's resource tracker (which
    unlinks it if the creator is killed before it could). The worker maps it by path, never
    creating or unlinking it, and says so; the creator then unlinks the name at once
    (``unlink``). Both mappings stay valid — a segment lives while anything maps it — and
    nothing is left in /dev/shm for the tracker to clean up or warn about, however either
    process ends. ``close`` unlinks it too, if the worker never got that far.

    The mapping belongs to the tensors: each view holds the ``mmap`` object (``torch.frombuffer``
    keeps a reference to the buffer, not a lock on it), and the memory is unmapped when the last
    view goes. ``close`` drops the arena's own reference only, never unmapping memory a view
    still reads; a view kept past ``close`` reads valid (if stale) memory, never a freed page.
    """

    def __init__(self, nbytes: int, *, name: str | None = None) -> None:
        self.nbytes = nbytes
        self.owner = name is None
        self._shm: shared_memory.SharedMemory | None = None
        if self.owner:
            name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
            # creates (exclusively), sizes and registers the name; its own mapping is not used
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            self._shm.close()
        # Map by path with O_RDWR and no O_CREAT: attaching never creates a stray segment.
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            buf = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.name: str = name
        self.tensor: torch.Tensor | None = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    def unlink(self) -> None:
        """Remove the name (owner only; idempotent). Mappings made before stay valid."""
        if self._shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()  # also unregisters it from the resource tracker
            self._shm = None

    def close(self) -> None:
        self.tensor = None
        self.unlink()


def shm_mappings(pid: int | str = "self") -> dict[str, int]:
    """The ring segments a process maps: name -> bytes mapped (``/proc/<pid>/maps``; a segment
    unlinked after mapping shows there as ``(deleted)``). Empty where /proc is missing."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or SHM_PREFIX not in fields[5]:
            continue
        name = Path(fields[5].removesuffix(" (deleted)")).name
        if name.startswith(SHM_PREFIX):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out[name] = out.get(name, 0) + end - start
    return out


class SlotRing:
    """Typed views into the slots of one arena, per the layout. Each slot holds both specs'
    tensors (name -> ``TensorSpec``, shapes at their maximum: max microbatch, max length); a
    smaller microbatch is stored contiguously at the start of its region, so views stay
    contiguous."""

    def __init__(self, layout: SlotLayout, arena_u8: torch.Tensor, *, shm: ShmArena | None = None):
        if arena_u8.numel() < layout.total_nbytes:
            raise ChannelError(
                f"arena has {arena_u8.numel()} bytes, layout needs {layout.total_nbytes}"
            )
        self.layout = layout
        self._bytes: torch.Tensor | None = arena_u8
        self._shm = shm

    @classmethod
    def create(cls, layout: SlotLayout, *, device: torch.device, shared: bool) -> SlotRing:
        """Allocate once. CPU + shared -> shared memory; CUDA tensors are shared by IPC handle."""
        if device.type == "cpu" and shared:
            shm = ShmArena(layout.total_nbytes)
            return cls(layout, shm.tensor, shm=shm)
        return cls(layout, torch.zeros(layout.total_nbytes, dtype=torch.uint8, device=device))

    def handle(self) -> tuple:
        """What the worker needs to map the same memory (picklable; sent once, at start)."""
        if self._shm is not None:
            return (self.layout, "shm", self._shm.name)
        return (self.layout, "tensor", self._bytes)

    @classmethod
    def attach(cls, handle: tuple) -> SlotRing:
        layout, kind, ref = handle
        if kind == "shm":
            shm = ShmArena(layout.total_nbytes, name=ref)
            return cls(layout, shm.tensor, shm=shm)
        return cls(layout, ref)

    @property
    def device(self) -> torch.device:
        return self._live().device

    @property
    def shm_name(self) -> str | None:
        return self._shm.name if self._shm is not None else None

    def mapped_elsewhere(self) -> None:
        """The worker has mapped the ring: unlink its name (`ShmArena`; no-op off shared memory)."""
        if self._shm is not None:
            self._shm.unlink()

    def _live(self) -> torch.Tensor:
        if self._bytes is None:
            raise ChannelError("the slot ring is closed")
        return self._bytes

    def slot_ptr(self, slot: int) -> int:
        return self._live()[slot * self.layout.slot_nbytes :].data_ptr()

    def view(self, slot: int, part: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        ts = self.layout.spec(part)[name]
        start = slot * self.layout.slot_nbytes + self.layout.offsets[(part, name)]
        n = math.prod(shape) * ts.dtype.itemsize
        return self._live()[start : start + n].view(ts.dtype).view(shape)

    def views(self, slot: int, part: str, shapes: Mapping[str, tuple]) -> dict[str, torch.Tensor]:
        return {name: self.view(slot, part, name, tuple(s)) for name, s in shapes.items()}

    def write(
        self, slot: int, part: str, tensors: Mapping[str, torch.Tensor], *, where: str
    ) -> dict:
        """Copy tensors into a slot (validated against the spec); return their shapes."""
        shapes = check_shapes(self.layout.spec(part), tensors, where=where)
        for name, dst in self.views(slot, part, shapes).items():
            dst.copy_(tensors[name])
        return shapes

    def poison(self, slot: int, part: str) -> None:
        full = {n: ts.shape for n, ts in self.layout.spec(part).items()}
        for v in self.views(slot, part, full).values():
            v.fill_(float("nan") if v.is_floating_point() else -1)

    def close(self) -> None:
        on_gpu = self._bytes is not None and self._bytes.is_cuda
        self._bytes = None
        if self._shm is not None:
            self._shm.close()
        if on_gpu:
            # A CUDA tensor shared by IPC stays allocated in its producer until torch sees that
            # every consumer let go of it; without this the ring outlives close() (a new
            # channel's ring would then come on top of it).
            torch.cuda.ipc_collect()
