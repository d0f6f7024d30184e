"""Windows of a whole batch of documents, columnar: flat token arrays in, an Arrow batch out.

The align job's hot path: `cut_batch` runs the Numba cutter over the batch's concatenated token
and chunk arrays, and `to_record_batch` gathers every shard column for all windows at once; no
Python runs per window or per token. Same rules as `tokenbridge.alignment.windows`, the
per-document reference the tests compare it with, plus the pieces of long documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tokenbridge.alignment import window_kernel
from tokenbridge.formats import shard_schema


@dataclass(frozen=True)
class BatchText:
    """The UTF-8 bytes of a batch's texts, concatenated; row b is data[splits[b]:splits[b+1]]."""

    data: np.ndarray  # uint8 [bytes]
    splits: np.ndarray  # int64 [B + 1]

    @staticmethod
    def from_texts(texts: list[str]) -> BatchText:
        encoded = [t.encode("utf-8") for t in texts]
        splits = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=splits[1:])
        return BatchText(np.frombuffer(b"".join(encoded), np.uint8), splits)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.splits)


@dataclass(frozen=True)
class Side:
    """One tokenizer's tokens over a batch (a `BatchEncoding`'s ids and row splits)."""

    ids: np.ndarray  # int32 [N]
    splits: np.ndarray  # int64 [B + 1]
    bos: int | None  # the id every window starts with, None = none
    eos: int | None  # the id the document's last window ends with


@dataclass(frozen=True)
class RowPlan:
    """How each row is cut: from which byte, up to which byte windows are final, whether the row
    ends its document (EOS, and the row end is a cut), whether an uncuttable span drops it."""

    start_byte: np.ndarray  # int64 [B]
    final_byte: np.ndarray  # int64 [B]
    doc_end: np.ndarray  # bool [B]
    drop_on_error: np.ndarray  # bool [B]
    row_ok: np.ndarray  # bool [B]: False = skip (the row failed an earlier stage)

    @staticmethod
    def whole(text: BatchText, row_ok: np.ndarray) -> RowPlan:
        n = text.splits.size - 1
        return RowPlan(
            np.zeros(n, np.int64),
            text.lengths.astype(np.int64),
            np.ones(n, np.bool_),
            np.ones(n, np.bool_),
            np.ascontiguousarray(row_ok, np.bool_),
        )


@dataclass(frozen=True)
class Cut:
    """`cut_kernel`'s output, named. Positions are row-relative; sides: student, teachers."""

    w_row: np.ndarray  # int64 [W]
    w_bytes: np.ndarray  # int64 [2, W]
    w_chars: np.ndarray  # int64 [2, W]
    w_lo: np.ndarray  # int64 [sides, W] token index (row-relative) where the window starts
    w_hi: np.ndarray  # int64 [sides, W]
    w_eos: np.ndarray  # bool [W]
    status: np.ndarray  # int8 [B], window_kernel.OK / NO_TOKENS / UNCUTTABLE / BAD_CHUNKS
    win_splits: np.ndarray  # int64 [B + 1]
    next_pos: np.ndarray  # int64 [2, B] (byte, char) of the first window not cut, -1 = none
    err_chars: np.ndarray  # int64 [2, B] first uncuttable span
    err_need: np.ndarray  # int64 [sides, B] tokens each side needs for it
    skipped: np.ndarray  # int64 [B] uncuttable spans skipped (pieces) or met (whole rows)
    kept_chunks: np.ndarray  # int64 [2, T, B] chunk range of the cut windows, row-relative
    kept_tokens: np.ndarray  # int64 [2, sides, B]
    seam_moved: np.ndarray  # bool [B] the start was not a cut point: the nearest one before it

    @property
    def num_windows(self) -> int:
        return int(self.w_row.size)


def cut_batch(
    text: BatchText,
    student: Side,
    teachers: list[tuple[Side, object]],
    *,
    max_student_tokens: int,
    max_teacher_tokens: int,
    stride_chars: int | None,
    plan: RowPlan,
) -> Cut:
    """Cut every row of a batch; teachers: (Side, its `BatchAlignment` to the student)."""
    if not teachers:
        raise ValueError("cutting windows needs at least one teacher")
    sides = [student] + [t for t, _ in teachers]
    limits = [max_student_tokens] + [max_teacher_tokens] * len(teachers)
    room = np.array([m - (s.bos is not None) for s, m in zip(sides, limits)], np.int64)
    eos_add = np.array([s.eos is not None for s in sides], np.int64)
    als = [al for _, al in teachers]
    c_sizes = [al.chunk_kind.size for al in als]
    c_base = np.zeros(len(als) + 1, np.int64)
    np.cumsum(c_sizes, out=c_base[1:])
    out = window_kernel.cut_kernel(
        text.data,
        text.splits,
        np.ascontiguousarray(student.splits, np.int64),
        np.stack([np.asarray(t.splits, np.int64) for t, _ in teachers]),
        np.stack([np.asarray(al.chunk_splits, np.int64) for al in als]),
        np.concatenate([al.chunk_student_end for al in als]).astype(np.int64),
        np.concatenate([al.chunk_teacher_end for al in als]).astype(np.int64),
        np.concatenate([al.chunk_byte_end for al in als]).astype(np.int64),
        c_base,
        room,
        eos_add,
        int(stride_chars or 0),
        plan.start_byte,
        plan.final_byte,
        plan.doc_end,
        plan.drop_on_error,
        plan.row_ok,
    )
    return Cut(*out)


def _list_column(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32()))


def to_record_batch(
    cut: Cut,
    text: BatchText,
    student: Side,
    teachers: list[tuple[Side, object]],
    *,
    doc_ids: pa.Array,
    char_base: np.ndarray,
    window_base: np.ndarray,
    schema: pa.Schema,
    extras: dict[str, tuple[int, np.ndarray, int]] | None = None,
) -> pa.RecordBatch:
    """The shard rows of every window of `cut`, column by column.

    doc_ids: per row; char_base: per row, the document position of the row's first character
    (pieces); window_base: per row, the index of its first window in the document. extras:
    column name -> (side: 0 student, i + 1 teacher i; flat values over that side's tokens;
    value for its BOS/EOS), for schemas with extra per-token columns.
    """
    rows = cut.w_row
    eos = cut.w_eos
    zeros = np.zeros(rows.size, np.int64)
    sides = [student] + [t for t, _ in teachers]

    def tokens(values, side: int, *, pad: int | None = None, shift=None) -> pa.Array:
        s = sides[side]
        head = (s.bos or 0) if pad is None else pad
        tail = (s.eos or 0) if pad is None else pad
        offsets, flat = window_kernel.gather_lists(
            values,
            s.splits,
            rows,
            cut.w_lo[side],
            cut.w_hi[side],
            head,
            s.bos is not None,
            tail,
            s.eos is not None,
            eos,
            zeros if shift is None else shift,
            shift is not None,
        )
        return _list_column(offsets, flat)

    t_offsets, t_bytes = window_kernel.gather_bytes(
        text.data, text.splits, rows, cut.w_bytes[0], cut.w_bytes[1]
    )
    cols = {
        "doc_id": doc_ids.take(pa.array(rows)),
        "window": pa.array((window_base[rows] + _rank_in_row(rows)).astype(np.int32)),
        "char_start": pa.array(char_base[rows] + cut.w_chars[0]),
        "char_end": pa.array(char_base[rows] + cut.w_chars[1]),
        "text": pa.StringArray.from_buffers(
            rows.size, pa.py_buffer(t_offsets), pa.py_buffer(t_bytes)
        ),
        "student_ids": tokens(student.ids, 0),
    }
    for i, (side, al) in enumerate(teachers):
        first, count = window_kernel.chunk_shift(
            al.student_chunk, student.splits, rows, cut.w_lo[0], cut.w_hi[0]
        )
        cols[shard_schema.teacher_ids_column(i)] = tokens(side.ids, i + 1)
        cols[shard_schema.teacher_chunk_column(i)] = tokens(
            al.teacher_chunk, i + 1, pad=-1, shift=first
        )
        cols[shard_schema.teacher_student_chunk_column(i)] = tokens(
            al.student_chunk, 0, pad=-1, shift=first
        )
        cols[shard_schema.teacher_n_chunks_column(i)] = pa.array(count)
    for name, (side, values, pad) in (extras or {}).items():
        cols[name] = tokens(np.ascontiguousarray(values, np.int32), side, pad=pad)
    missing = [f.name for f in schema if f.name not in cols]
    if missing:
        raise ValueError(f"no values for shard column(s) {missing}")
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


def _rank_in_row(rows: np.ndarray) -> np.ndarray:
    """0, 1, 2... within each run of equal row indices (windows come grouped by row)."""
    if rows.size == 0:
        return rows
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    run = np.repeat(starts, np.diff(np.r_[starts, rows.size]))
    return np.arange(rows.size) - run


def ranges_mask(n: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """bool [n]: True inside any [lo[j], hi[j]) (ranges may be empty, not overlapping)."""
    marks = np.zeros(n + 1, np.int64)
    keep = hi > lo
    np.add.at(marks, lo[keep], 1)
    np.add.at(marks, hi[keep], -1)
    return np.cumsum(marks[:-1]) > 0
