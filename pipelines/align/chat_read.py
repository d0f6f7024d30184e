"""Conversation rows out of ``.jsonl`` and ``.parquet`` files, for the align job's chat path.

A conversation is a whole record (``messages``, or ``prompt`` + ``completion``), so these
readers yield the record (`Row`) and leave parsing to `tokenbridge.chat.rows.parse_row`; only
what is bad before parsing (bytes that are not UTF-8, a line that is not JSON) is a dead letter
here. A file of plain text records in a conversation job is one dead letter
(`ROW_FORMAT_MISMATCH`): one job writes one shard schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from pipelines.align import readers
from tokenbridge.chat import rows

ROW_FORMAT_MISMATCH = "row_format_mismatch"
CHAT_SUFFIXES = readers.JSONL_SUFFIXES + readers.PARQUET_SUFFIXES


@dataclass(frozen=True)
class Row:
    """One record of a conversation file, not parsed yet."""

    doc_id: str  # file id + ":" + row index, as the text readers name jsonl documents
    row: int  # 0-based record index in its file
    value: object  # the decoded JSON value / parquet row dict
    fmt: str  # rows.MESSAGES or rows.PROMPT_COMPLETION (the file's format)


def _mismatch(path: str, doc_id: str, found: str, *, row: int | None = None) -> dict:
    return readers.dead_letter(
        path,
        ROW_FORMAT_MISMATCH,
        f"this is a conversation job ({rows.MESSAGES} or {rows.PROMPT_COMPLETION} rows) but the "
        f"file holds {found}; align it in a run of its own (one job writes one shard schema)",
        row=row,
        doc_id=doc_id,
    )


def _file_format(value, *, fixed: str | None, where: str) -> str | None:
    """The file's row format from its first record; None when it cannot be told (the caller
    dead-letters the file)."""
    if fixed is not None:
        return fixed
    try:
        return rows.detect_format(value, where=where)
    except ValueError:
        return None


def read_jsonl_rows(
    path: str,
    doc_id: str,
    *,
    row_format: str | None,
    split: readers.Split | None = None,
    pos: readers.Position | None = None,
) -> Iterator[Row | dict]:
    """Records of a jsonl file (or of one byte range of it) as `Row`s, bad lines as dead
    letters. `row_format` None: detected from the first record read."""
    fmt = row_format
    if fmt is None and split is not None and split.start:
        fmt = peek_format(path)  # a later byte range: the format of the file's first record
    for record in readers.jsonl_records(path, doc_id, split=split, pos=pos):
        if isinstance(record, dict):
            yield record  # a dead letter
            continue
        row, did, value = record
        if fmt is None:
            fmt = _file_format(value, fixed=None, where=f"{path} row {row}")
            if fmt is None:
                keys = sorted(value)[:10] if isinstance(value, dict) else type(value).__name__
                yield _mismatch(path, did, f"records with keys {keys}", row=row)
                return
        if fmt == rows.TEXT:
            yield _mismatch(path, did, "text rows", row=row)
            return
        yield Row(did, row, value, fmt)


def read_parquet_rows(path: str, doc_id: str, *, row_format: str | None) -> Iterator[Row | dict]:
    """Records of a parquet file as `Row`s (a ``messages`` column of structs reads as dicts)."""
    import pyarrow.parquet as pq

    with readers._open(path, binary_seekable=True) as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        fmt = _file_format({n: None for n in names}, fixed=row_format, where=path)
        if fmt is None or fmt == rows.TEXT:
            yield _mismatch(path, doc_id, f"columns {names[:10]}")
            return
        wanted = [rows.MESSAGES] if fmt == rows.MESSAGES else ["prompt", "completion"]
        wanted += [c for c in ("tools",) if c in names]
        missing = [c for c in wanted if c not in names]
        if missing:
            yield readers.dead_letter(
                path, readers.MISSING_FIELD, f"no column {missing[0]!r} (found {names[:10]})"
            )
            return
        row = 0
        for batch in pf.iter_batches(columns=wanted, batch_size=1024):
            for value in batch.to_pylist():
                yield Row(f"{doc_id}:{row}", row, value, fmt)
                row += 1


def read_rows(
    path: str,
    doc_id: str,
    *,
    row_format: str | None,
    split: readers.Split | None = None,
    pos: readers.Position | None = None,
) -> Iterator[Row | dict]:
    """Every conversation record (and dead letter) of one file or byte range. Never raises on
    bad input: a failure while reading ends the file with a dead letter."""
    fmt = readers.file_format(path)
    if fmt == "jsonl":
        gen = read_jsonl_rows(path, doc_id, row_format=row_format, split=split, pos=pos)
    elif fmt == "parquet":
        gen = read_parquet_rows(path, doc_id, row_format=row_format)
    else:
        yield _mismatch(path, doc_id, f"a {fmt or 'file of unknown type'} (not jsonl / parquet)")
        return
    try:
        yield from gen
    except Exception as e:  # noqa: BLE001 - any failure to read a file is that file's dead letter
        yield readers.dead_letter(
            path, readers.UNREADABLE_FILE, f"{type(e).__name__}: {e}", doc_id=doc_id
        )


def peek_format(path: str) -> str | None:
    """The row format of a file's first record (jsonl, parquet), or None (txt, empty, unreadable:
    the text job decides what to do with it)."""
    fmt = readers.file_format(path)
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            with readers._open(path, binary_seekable=True) as f:
                names = pq.ParquetFile(f).schema_arrow.names
            return rows.detect_format({n: None for n in names})
        if fmt == "jsonl":
            with readers._open(path) as f:
                for raw in iter(f.readline, b""):
                    if raw.strip():
                        return rows.detect_format(json.loads(raw))
    except (ValueError, OSError):
        return None
    return None
