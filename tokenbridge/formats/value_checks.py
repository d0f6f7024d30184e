"""Values checked before they reach a model: one record batch of a shard at a time, vectorised.

A checksum says nothing about a writer's bug, a marker without checksums or a run with
``data.verify=never``, and a wrong id is worse than a crash: one past the vocabulary fails in an
embedding lookup that names nothing (on a GPU, a device-side assert), one inside it trains on
wrong tokens unnoticed. So each batch is checked once with numpy reductions over its flat
buffers, and the row is looked for only once a check has failed (what: docs/integrity.md).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from tokenbridge.formats import shard_schema
from tokenbridge.formats.checksums import COST, IntegrityError


class BadValueError(IntegrityError):
    """A value out of its range: `where` (file), `row` (in the file), `column`."""

    def __init__(
        self, where: str, *, row: int, column: str, detail: str, rebuild: str = "the align job"
    ):
        self.where, self.row, self.column = where, row, column
        super().__init__(
            f"{where} row {row} column {column}: {detail}; the file is damaged or was written "
            f"by a faulty writer (re-run {rebuild})"
        )


def _lists(batch: pa.RecordBatch, column: str, where: str, first_row: int):
    """(offsets, values) of a list<int32> column as numpy views, the offsets checked."""
    arr = batch.column(column)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    steps = np.diff(offsets)
    bad = None
    if len(offsets) and (offsets[0] < 0 or offsets[-1] > len(values)):
        bad = 0 if offsets[0] < 0 else int(np.flatnonzero(offsets > len(values))[0]) - 1
    elif len(steps) and steps.min() < 0:
        bad = int(np.flatnonzero(steps < 0)[0])
    if bad is not None:
        raise BadValueError(
            where, row=first_row + max(bad, 0), column=column, detail="list offsets out of order"
        )
    return offsets, values


def _row_of(offsets: np.ndarray, position: int) -> int:
    return int(np.searchsorted(offsets, position, side="right") - 1)


def _check_range(batch, column: str, *, lo: int, hi: int, where: str, first_row: int, what: str):
    offsets, values = _lists(batch, column, where, first_row)
    v = values[offsets[0] : offsets[-1]] if len(offsets) else values[:0]
    if len(v) and (v.min() < lo or v.max() >= hi):
        pos = int(np.flatnonzero((v < lo) | (v >= hi))[0]) + int(offsets[0])
        row = _row_of(offsets, pos)
        raise BadValueError(
            where,
            row=first_row + row,
            column=column,
            detail=f"value {int(values[pos])} at position {pos - int(offsets[row])} outside "
            f"[{lo}, {hi}) ({what})",
        )
    return offsets, values


def _check_chunks(batch, column: str, n_chunks: np.ndarray, *, where: str, first_row: int):
    """Chunk indices in [-1, n_chunks of their row): the minimum over the whole buffer, the
    maximum per row by one `maximum.reduceat` over the non-empty rows."""
    offsets, values = _check_range(
        batch, column, lo=-1, hi=2**31 - 1, where=where, first_row=first_row, what="chunk index"
    )
    starts, lengths = offsets[:-1], np.diff(offsets)
    rows = np.flatnonzero(lengths > 0)
    if not len(rows):
        return offsets
    row_max = np.maximum.reduceat(values, starts[rows])
    # reduceat's segments run to the next start: the last one to the end of `values`, which may
    # hold bytes past the last row; those rows are checked on their own slice
    last = rows[-1]
    row_max[-1] = values[starts[last] : offsets[last + 1]].max()
    over = row_max >= n_chunks[rows]
    if over.any():
        r = int(rows[np.flatnonzero(over)[0]])
        raise BadValueError(
            where,
            row=first_row + r,
            column=column,
            detail=f"chunk index {int(row_max[np.flatnonzero(over)[0]])} >= the row's "
            f"n_chunks {int(n_chunks[r])}",
        )
    return offsets


def _same_lengths(
    a: np.ndarray, b: np.ndarray, *, where: str, first_row: int, column: str, of: str
):
    if not np.array_equal(np.diff(a), np.diff(b)):
        row = int(np.flatnonzero(np.diff(a) != np.diff(b))[0])
        raise BadValueError(
            where, row=first_row + row, column=column, detail=f"length differs from {of}"
        )


def check_batch(
    batch: pa.RecordBatch, meta: shard_schema.ShardMeta, *, where: str, first_row: int = 0
):
    """Raise `BadValueError` for the first value of `batch` out of its range (the checks:
    docs/integrity.md, "Values, before they reach a model"). `where`: the file; `first_row`: the batch's first row in that file. Its time
    and rows count in `checksums.COST`."""
    t0 = time.perf_counter()
    try:
        _check(batch, meta, where=where, first_row=first_row)
    finally:
        COST.check_seconds += time.perf_counter() - t0
        COST.checked_rows += batch.num_rows


def _check(
    batch: pa.RecordBatch, meta: shard_schema.ShardMeta, *, where: str, first_row: int
) -> None:
    # ids within the tokenizer's vocabulary (from the shard metadata); the lm_head may be wider,
    # never narrower (the trainer's preflight checks that)
    s_offsets, _ = _check_range(
        batch, "student_ids", lo=0, hi=meta.student.vocab_size, where=where,
        first_row=first_row, what=f"student vocabulary {meta.student.name}",
    )  # fmt: skip
    for i, t in enumerate(meta.teachers):
        ids = shard_schema.teacher_ids_column(i)
        t_offsets, _ = _check_range(
            batch, ids, lo=0, hi=t.vocab_size, where=where, first_row=first_row,
            what=f"teacher {i} vocabulary {t.name}",
        )  # fmt: skip
        n_col = shard_schema.teacher_n_chunks_column(i)
        n_chunks = batch.column(n_col).to_numpy(zero_copy_only=False)
        if len(n_chunks) and n_chunks.min() < 0:
            row = int(np.flatnonzero(n_chunks < 0)[0])
            raise BadValueError(
                where, row=first_row + row, column=n_col, detail=f"{int(n_chunks[row])} < 0"
            )
        for col, ref, of in (
            (shard_schema.teacher_chunk_column(i), t_offsets, ids),
            (shard_schema.teacher_student_chunk_column(i), s_offsets, "student_ids"),
        ):
            offsets = _check_chunks(batch, col, n_chunks, where=where, first_row=first_row)
            _same_lengths(offsets, ref, where=where, first_row=first_row, column=col, of=of)


def check_cached_row(cached, *, vocab_size: int, where: str, row: int) -> None:
    """Raise `BadValueError` unless one teacher-cache row's decoded outputs (a
    `tokenbridge.formats.teacher_cache_reader.CachedRow`) may reach a loss: ``topk_ids`` in
    ``[-1, vocab_size)`` of the teacher (packed ids have room past the vocabulary: 16 bits
    hold 65,536 ids for a 49,152 vocabulary), no log-prob NaN or +inf. A handful of numpy
    reductions over the row's U*K values; `where`: the cache file, `row`: the row in it."""
    ids = np.asarray(cached.topk_ids)
    if ids.size and (ids.min() < -1 or ids.max() >= vocab_size):
        pos = int(np.flatnonzero((ids.ravel() < -1) | (ids.ravel() >= vocab_size))[0])
        raise BadValueError(
            where, row=row, column="topk_ids", rebuild="the teacher-cache job",
            detail=f"id {int(ids.ravel()[pos])} at position {pos // max(ids.shape[-1], 1)} "
            f"outside [-1, {vocab_size}) (teacher vocabulary)",
        )  # fmt: skip
    for column in ("topk_logprobs", "tail_logprob", "target_logprob"):
        x = getattr(cached, column, None)
        if x is None:
            continue
        x = np.asarray(x, dtype=np.float32).ravel()
        bad = np.isnan(x) | (x == np.inf)
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            raise BadValueError(
                where, row=row, column=column, rebuild="the teacher-cache job",
                detail=f"{x[pos]} at value {pos} (a log-prob is finite or -inf)",
            )  # fmt: skip
