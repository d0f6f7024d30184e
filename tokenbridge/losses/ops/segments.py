"""Batch alignment tensors and the segment operations that reduce tokens to aligned chunks.

`collate_aligned` pads one teacher's shard columns into an `AlignedBatch`; `index_chunks` numbers
its chunks over the batch (`ChunkIndex`: each chunk's first and last position per side, each
position's predicted chunk). Tokens reach chunks by segment ops, never a one-hot [C, T] matmul;
position conventions: docs/losses.md, "Positions and chunks".

Legend: B batch rows, S student positions, T teacher positions, G chunks in the batch, L slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tokenbridge.formats import shard_schema


@dataclass(frozen=True)
class AlignedBatch:
    """One (student, teacher) pair of a batch, padded. All tensors int64 on one device."""

    student_ids: Tensor  # [B, S]
    student_len: Tensor  # [B]
    student_chunk: Tensor  # [B, S], -1 special / padding
    teacher_ids: Tensor  # [B, T]
    teacher_len: Tensor  # [B]
    teacher_chunk: Tensor  # [B, T]
    n_chunks: Tensor  # [B]
    # conversation shards: per chunk its kind ([B, max n_chunks], -1 past a row's chunks):
    # 0..3 text chunks, shard_schema.CHUNK_OPEN / CHUNK_EOT turn-marker pairs; None = all text
    chunk_kind: Tensor | None = None

    def __post_init__(self) -> None:
        b = self.student_ids.shape[0]
        checks = {
            "student_len": (self.student_len, (b,)),
            "student_chunk": (self.student_chunk, tuple(self.student_ids.shape)),
            "teacher_len": (self.teacher_len, (b,)),
            "teacher_chunk": (self.teacher_chunk, tuple(self.teacher_ids.shape)),
            "n_chunks": (self.n_chunks, (b,)),
        }
        if self.chunk_kind is not None and (
            self.chunk_kind.dim() != 2 or self.chunk_kind.shape[0] != b
        ):
            raise ValueError(
                f"AlignedBatch.chunk_kind: expected [{b}, C], got {self.chunk_kind.shape}"
            )
        if self.student_ids.dim() != 2 or self.teacher_ids.dim() != 2:
            raise ValueError("AlignedBatch: student_ids and teacher_ids must be [B, T]")
        if self.teacher_ids.shape[0] != b:
            raise ValueError("AlignedBatch: student and teacher batch sizes differ")
        for name, (t, shape) in checks.items():
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"AlignedBatch.{name}: expected shape {shape}, got {tuple(t.shape)}"
                )


def collate_aligned(
    rows: Sequence[Mapping], teacher: int, *, student_pad_id: int = 0, teacher_pad_id: int = 0
) -> AlignedBatch:
    """Pad shard rows (dicts keyed by schema column names) into the `AlignedBatch` of one teacher."""

    def pad(lists: list[np.ndarray], fill: int) -> Tensor:
        width = max((len(x) for x in lists), default=0)
        out = np.full((len(lists), max(width, 1)), fill, dtype=np.int64)
        for i, x in enumerate(lists):
            out[i, : len(x)] = x
        return torch.from_numpy(out)

    def col(row: Mapping, name: str, i: int) -> np.ndarray:
        if name not in row:
            raise KeyError(f"shard row {i}: missing column {name!r}")
        return np.asarray(row[name], dtype=np.int64)

    s_ids = [col(r, "student_ids", i) for i, r in enumerate(rows)]
    t_ids = [col(r, shard_schema.teacher_ids_column(teacher), i) for i, r in enumerate(rows)]
    s_chunk = [
        col(r, shard_schema.teacher_student_chunk_column(teacher), i) for i, r in enumerate(rows)
    ]
    t_chunk = [col(r, shard_schema.teacher_chunk_column(teacher), i) for i, r in enumerate(rows)]
    for i in range(len(rows)):
        if len(s_chunk[i]) != len(s_ids[i]) or len(t_chunk[i]) != len(t_ids[i]):
            raise ValueError(
                f"shard row {i}: chunk column length differs from its ids (teacher {teacher})"
            )
    n_chunks = [
        int(col(r, shard_schema.teacher_n_chunks_column(teacher), i)) for i, r in enumerate(rows)
    ]
    return AlignedBatch(
        student_ids=pad(s_ids, student_pad_id),
        student_len=torch.tensor([len(x) for x in s_ids], dtype=torch.int64),
        student_chunk=pad(s_chunk, -1),
        teacher_ids=pad(t_ids, teacher_pad_id),
        teacher_len=torch.tensor([len(x) for x in t_ids], dtype=torch.int64),
        teacher_chunk=pad(t_chunk, -1),
        n_chunks=torch.tensor(n_chunks, dtype=torch.int64),
    )


def shift_targets(ids_BT: Tensor, len_B: Tensor) -> Tensor:
    """[B, T]: the token predicted at each position (ids[i + 1]), -1 past the row's last token."""
    width = ids_BT.shape[1]
    pos = torch.arange(width, device=ids_BT.device)
    nxt = torch.cat([ids_BT[:, 1:], ids_BT.new_full((ids_BT.shape[0], 1), -1)], dim=1)
    return torch.where(pos[None, :] + 1 < len_B[:, None], nxt, -1)


@dataclass(frozen=True)
class ChunkSide:
    """One side (student or teacher) of a `ChunkIndex`. Positions are flat: b * width + i."""

    width: int  # padded sequence length of this side
    first: Tensor  # [G] flat position of the chunk's first token, -1 if the side is empty
    last: Tensor  # [G] flat position of its last token, -1 if empty
    count: Tensor  # [G] number of tokens
    targets: Tensor  # [B * width] token predicted at each position, -1 none
    target_chunk: Tensor  # [B * width] chunk of the token predicted at each position, -1 none

    def _predicted(self) -> Tensor:
        """[G] the chunk is non-empty and its first token has a predicting position."""
        return (self.count > 0) & (self.first % self.width > 0)

    def start_rows(self) -> Tensor:
        """[G] position whose distribution predicts the chunk's first token; -1 if none."""
        return torch.where(self._predicted(), self.first - 1, -1)

    def last_rows(self) -> Tensor:
        """[G] position whose distribution predicts the chunk's last token; -1 if none."""
        return torch.where(self._predicted(), self.last - 1, -1)


@dataclass(frozen=True)
class ChunkIndex:
    n_chunks: int  # G, chunks in the whole batch
    chunk_row: Tensor  # [G] batch row of each chunk
    student: ChunkSide
    teacher: ChunkSide
    kind: Tensor | None = None  # [G] chunk kinds (conversation shards), None = all text
    # [G] bool: the chunks a loss may use (trained, of the loss's kinds; `tokenbridge.losses.ops.turns`);
    # None = all. `context.complete_chunks` applies it, so every chunk mode and its count do
    select: Tensor | None = None


def _side(ids_BT: Tensor, len_B: Tensor, chunk_BT: Tensor, *, offsets_B: Tensor, g: int, who: str):
    b, width = ids_BT.shape
    pos = torch.arange(width, device=ids_BT.device)
    in_row = pos[None, :] < len_B[:, None]
    real = (chunk_BT >= 0) & in_row
    n_B = torch.diff(torch.cat([offsets_B, offsets_B.new_tensor([g])]))
    bad = real & (chunk_BT >= n_B[:, None])
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{who}_chunk: row {row} holds chunk id {int(chunk_BT[bad].max())} but n_chunks is "
            f"{int(n_B[row])}"
        )
    gid = torch.where(real, chunk_BT + offsets_B[:, None], -1).reshape(-1)
    flat = torch.arange(b * width, device=ids_BT.device)
    sel = gid >= 0
    count = torch.bincount(gid[sel], minlength=g)
    first = torch.full((g,), b * width, dtype=torch.int64, device=ids_BT.device)
    first = first.scatter_reduce(0, gid[sel], flat[sel], "amin")
    last = torch.full((g,), -1, dtype=torch.int64, device=ids_BT.device)
    last = last.scatter_reduce(0, gid[sel], flat[sel], "amax")
    first = torch.where(count > 0, first, -1)
    ragged = (count > 0) & (last - first + 1 != count)
    if bool(ragged.any()):
        raise ValueError(f"{who}_chunk: chunk {int(ragged.nonzero()[0, 0])} is not contiguous")
    nxt_chunk = torch.cat([gid.view(b, width)[:, 1:], gid.new_full((b, 1), -1)], dim=1)
    targets = shift_targets(ids_BT, len_B)
    target_chunk = torch.where(targets >= 0, nxt_chunk, -1).reshape(-1)
    return ChunkSide(width, first, last, count, targets.reshape(-1), target_chunk)


def index_chunks(batch: AlignedBatch) -> ChunkIndex:
    """Per-chunk positions on both sides of a batch (chunk ids made global: row offset + c)."""
    n = batch.n_chunks
    if bool((n < 0).any()):
        raise ValueError("n_chunks must be >= 0")
    offsets = torch.cumsum(n, 0) - n
    g = int(n.sum())
    student = _side(
        batch.student_ids,
        batch.student_len,
        batch.student_chunk,
        offsets_B=offsets,
        g=g,
        who="student",
    )
    teacher = _side(
        batch.teacher_ids,
        batch.teacher_len,
        batch.teacher_chunk,
        offsets_B=offsets,
        g=g,
        who="teacher",
    )
    chunk_row = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n)
    kind = None
    if batch.chunk_kind is not None:
        # row b's chunks are global ids offsets[b] + c, c < n_chunks[b]: kinds in that order
        c = torch.arange(g, device=n.device) - offsets[chunk_row]
        kind = batch.chunk_kind[chunk_row, c]
    return ChunkIndex(g, chunk_row, student, teacher, kind=kind)


def segment_sum(values_N: Tensor, seg_N: Tensor, n_segments: int) -> Tensor:
    """[n_segments]: sum of the values of each segment id; ids < 0 are skipped. Differentiable."""
    keep = seg_N >= 0
    out = values_N.new_zeros((n_segments,) + tuple(values_N.shape[1:]))
    return out.index_add(0, seg_N[keep], values_N[keep])


def dedup_rows(ids_GL: Tensor, vals_GL: Tensor) -> tuple[Tensor, Tensor]:
    """Merge repeated ids within each row, summing their values.

    Returns (ids [G, L], vals [G, L]): the distinct ids of a row first (ascending), then empty
    slots (id -1, value 0). Slots with id < 0 on input are empty.
    """
    big = torch.iinfo(torch.int64).max
    key = torch.where(ids_GL >= 0, ids_GL, big)
    key_sorted, order = key.sort(dim=-1)
    vals_sorted = vals_GL.gather(-1, order)
    new = torch.ones_like(key_sorted, dtype=torch.bool)
    new[:, 1:] = key_sorted[:, 1:] != key_sorted[:, :-1]
    slot = new.cumsum(-1) - 1
    out_ids = torch.full_like(ids_GL, -1).scatter(-1, slot, key_sorted)
    out_vals = torch.zeros_like(vals_GL).scatter_add(-1, slot, vals_sorted)
    empty = out_ids == big
    out_ids = out_ids.masked_fill(empty | (out_ids < 0), -1)
    return out_ids, out_vals.masked_fill(out_ids < 0, 0.0)
