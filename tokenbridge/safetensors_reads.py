"""Boxes of safetensors tensors read with plain file reads, straight into their destination.

``safe_open`` maps the file: every page a read touches counts in the process's resident memory
(VmRSS, and so VmHWM) while the file stays mapped, and ``get_slice`` then copies the box into a
new tensor before it reaches its shard: a rank's rows held two or three times over. Here the
header is parsed once and a box of whole rows (FSDP's cut) in the file's dtype is read with
``readinto`` into its shard itself; any other box (some columns: TP's row-wise cut, or another
dtype) goes through a bounded block of whole rows. The page cache is the kernel's, not the
process's. Safetensors is little-endian, as every machine we run on.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

import torch

if TYPE_CHECKING:  # `weight_slices` reads through this module
    from tokenbridge.weight_slices import ShardTarget

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# the most a box that cannot be read in place holds beside its shard (one row when rows are larger)
BLOCK_BYTES = 16 * 2**20


class SafetensorsFileError(ValueError):
    """A safetensors file whose header or size is not what it says (named in the message)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype, shape, and bytes [begin, end) of the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | os.PathLike) -> dict[str, Entry]:
    """Every tensor of safetensors file `path`, checked against the file's size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > size - 8:
            raise SafetensorsFileError(f"{path}: not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise SafetensorsFileError(f"{path}: unreadable safetensors header: {e}") from e
    header.pop("__metadata__", None)
    entries = {}
    for key, info in header.items():
        if info.get("dtype") not in DTYPES:
            raise SafetensorsFileError(f"{path}: {key}: unknown dtype {info.get('dtype')!r}")
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        a, b = info["data_offsets"]
        begin, end = 8 + n + a, 8 + n + b
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 8 + n or end > size:
            raise SafetensorsFileError(
                f"{path}: {key}: data_offsets [{a}, {b}] do not hold a {list(shape)} "
                f"{info['dtype']} tensor in a file of {size} bytes"
            )
        entries[key] = Entry(dtype, shape, begin, end)
    return entries


def _bytes(t: torch.Tensor) -> memoryview:
    """The memory of contiguous tensor `t`, writable, as bytes."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _read_into(f: BinaryIO, at: int, buf: memoryview, *, what: str) -> None:
    """Bytes [at, at + len(buf)) of file `f` into `buf` (reads may return short)."""
    f.seek(at)
    done = 0
    while done < len(buf):
        got = f.readinto(buf[done:])
        if not got:
            raise SafetensorsFileError(f"{what}: the file ends at byte {at + done}")
        done += got


@torch.no_grad()
def read_box(f: BinaryIO, entry: Entry, target: ShardTarget, *, what: str) -> None:
    """`target`'s box of tensor `entry` of open file `f`, converted to its dtype, into its
    local tensor; `what` names the tensor in errors."""
    out = target.out
    if out.numel() == 0:
        return
    if not entry.shape:  # a 0-d weight: its one element
        one = torch.empty((), dtype=entry.dtype)
        _read_into(f, entry.begin, _bytes(one), what=what)
        out.copy_(one)
        return
    row_bytes = math.prod(entry.shape[1:]) * entry.dtype.itemsize
    rows = target.box[0]
    whole_rows = all(s == slice(0, n) for s, n in zip(target.box[1:], entry.shape[1:]))
    if whole_rows and out.dtype == entry.dtype and out.is_contiguous():
        _read_into(f, entry.begin + rows.start * row_bytes, _bytes(out), what=what)
        return
    step = max(1, BLOCK_BYTES // row_bytes)
    for start in range(rows.start, rows.stop, step):
        block = torch.empty((min(step, rows.stop - start), *entry.shape[1:]), dtype=entry.dtype)
        _read_into(f, entry.begin + start * row_bytes, _bytes(block), what=what)
        target.take_rows(block, start)  # the box's columns, converted to the shard's dtype
