"""Documents out of text files: ``.txt`` (one per file or per blank-line block), ``.jsonl`` (a
named field) and ``.parquet`` (a named column), optionally compressed (``.gz``, ``.bz2``, ...).

Plain generators over one file (a large ``.jsonl``: over a byte range, `plan_splits`), shared by
the job, the tests and the benchmarks. They never raise on bad input: each bad file, record or
value becomes a dead letter (`dead_letter`: file, row, line, field, reason) and reading goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from pipelines.plumbing.tagged import PARTIAL
from tokenbridge import urls

# dead-letter reasons (stable strings: they are counter names and stats keys)
UNREADABLE_FILE = "unreadable_file"
UNKNOWN_FORMAT = "unknown_format"
UNDECODABLE = "undecodable_utf8"
EMPTY_DOCUMENT = "empty_document"
BAD_JSON = "bad_json"
MISSING_FIELD = "missing_field"
BAD_FIELD_TYPE = "bad_field_type"

TXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".zst", ".deflate", ".lzma", ".xz")
TXT_MODES = ("file", "blocks")

# a blank line: a line break, optional spaces/tabs, another line break (and any run of them)
_BLOCK_SEP = re.compile(rb"\r?\n(?:[ \t]*\r?\n)+")


@dataclass(frozen=True)
class ReaderConfig:
    text_field: str = "text"  # jsonl field (dotted path for nested objects) / parquet column
    txt_mode: str = "file"  # "file": one document per .txt file; "blocks": per blank-line block

    def __post_init__(self):
        if self.txt_mode not in TXT_MODES:
            raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {self.txt_mode!r}")
        if not self.text_field:
            raise ValueError("text_field must be a non-empty field name")


@dataclass(frozen=True)
class Split:
    """Bytes [start, end) of a file (end None = to the end), whose first line is row `first_row`."""

    start: int = 0
    end: int | None = None
    first_row: int = 0


class Position:
    """Bytes of the input consumed so far (updated by the readers as they go)."""

    def __init__(self) -> None:
        self.bytes = 0


@dataclass(frozen=True)
class Doc:
    doc_id: str  # unique within a run: relative file name [+ ":" record index]
    text: str
    file: str = field(default="", compare=False)  # the file it came from, for dead letters


def dead_letter(
    file: str,
    reason: str,
    detail: str,
    *,
    row: int | None = None,
    line: int | None = None,
    field: str | None = None,
    doc_id: str | None = None,
    partial: bool = False,
) -> dict:
    """One dead-letter record. `partial`: the document still gave windows and the letter names
    what of it was skipped (a long document's uncuttable span or failed last pieces); such a
    letter carries ``"partial": true`` and is not a lost document (`tagged.dead_verdict`)."""
    record = {
        "file": file,
        "row": row,
        "line": line,
        "field": field,
        "doc_id": doc_id,
        "reason": reason,
        "detail": detail,
    }
    return {**record, PARTIAL: True} if partial else record


def file_format(path: str) -> str | None:
    """ "txt" / "jsonl" / "parquet" from the file name (after a compression suffix), or None."""
    name = PurePosixPath(path).name.lower()
    for c in COMPRESSION_SUFFIXES:
        if name.endswith(c):
            name = name[: -len(c)]
            break
    for fmt, suffixes in (
        ("txt", TXT_SUFFIXES),
        ("jsonl", JSONL_SUFFIXES),
        ("parquet", PARQUET_SUFFIXES),
    ):
        if name.endswith(suffixes):
            return fmt
    return None


def _open(path: str, *, binary_seekable: bool = False):
    """Open through Beam's FileSystems (local, gs://, hdfs:// ... alike); ``s3://`` through
    the jobs' storage layer (`pipelines.plumbing.storage`: one client per worker thread, and the
    environment's settings on a worker Beam handed no options, as Dask's), decompressed as
    FileSystems would."""
    from apache_beam.io.filesystem import CompressedFile, CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    from pipelines.plumbing import storage

    if urls.scheme(path) == "s3":
        raw = storage.open_read(path)
        kind = CompressionTypes.detect_compression_type(path)
        if binary_seekable or kind == CompressionTypes.UNCOMPRESSED:
            return raw
        return CompressedFile(raw, compression_type=kind)
    kind = CompressionTypes.UNCOMPRESSED if binary_seekable else CompressionTypes.AUTO
    return FileSystems.open(path, compression_type=kind)


def _decode(data: bytes, *, file: str, doc_id: str, row: int | None, line: int | None):
    """-> (text, None) or (None, dead letter) naming the first bad byte."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as e:
        where = f"byte {e.start}" + (f" of the block at line {line}" if line else "")
        return None, dead_letter(
            file,
            UNDECODABLE,
            f"invalid UTF-8 at {where}: {data[e.start : e.start + 4]!r}",
            row=row,
            line=line,
            doc_id=doc_id,
        )


def _doc_or_empty(file, doc_id, text, *, row=None, line=None, field=None):
    if not text.strip():
        return dead_letter(
            file,
            EMPTY_DOCUMENT,
            f"document has no non-whitespace text ({len(text)} chars)",
            row=row,
            line=line,
            field=field,
            doc_id=doc_id,
        )
    return Doc(doc_id, text, file)


def read_txt(path: str, doc_id: str, *, mode: str = "file") -> Iterator[Doc | dict]:
    with _open(path) as f:
        data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark is not text
        data = data[3:]
    if mode == "file":
        text, bad = _decode(data, file=path, doc_id=doc_id, row=None, line=None)
        yield bad if bad is not None else _doc_or_empty(path, doc_id, text)
        return
    start, line, index, any_block = 0, 1, 0, False
    for sep in [*_BLOCK_SEP.finditer(data), None]:
        end = sep.start() if sep is not None else len(data)
        block = data[start:end]
        if block.strip():
            any_block = True
            bid = f"{doc_id}:{index}"
            text, bad = _decode(block, file=path, doc_id=bid, row=index, line=line)
            yield bad if bad is not None else Doc(bid, text, path)
            index += 1
        if sep is not None:
            line += data.count(b"\n", start, sep.end())
            start = sep.end()
    if not any_block:
        yield _doc_or_empty(path, doc_id, data.decode("utf-8", errors="replace"))


def _get_field(obj, dotted: str):
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            raise KeyError(part)
        obj = obj[part]
    return obj


def _jsonl_lines(path: str, split: Split, pos: Position) -> Iterator[tuple[int, bytes]]:
    """(row, raw line) of a jsonl file or byte range, blank lines included (they keep their row
    numbers); `pos` counts the bytes as they are read."""
    with _open(path) as f:
        if split.start:
            f.seek(split.start)
        at = split.start
        # readline, not iteration: Beam's CompressedFile (for .gz etc.) is not iterable
        for row, raw in enumerate(iter(f.readline, b""), start=split.first_row):
            if split.end is not None and at >= split.end:
                break  # the next range's first line
            at += len(raw)
            pos.bytes += len(raw)
            yield row, raw
            raw = None  # a 40 MB line must not stay alive while the consumer works


def _jsonl_record(path: str, doc_id: str, row: int, raw: bytes) -> tuple[str, object] | dict | None:
    """One line -> (doc id, parsed value), a dead letter (not UTF-8, not JSON), or None (blank)."""
    line = row + 1
    did = f"{doc_id}:{row}"
    if not raw.strip():
        return None  # a blank line between records is not a record
    text, bad = _decode(raw, file=path, doc_id=did, row=row, line=line)
    if bad is not None:
        return bad
    try:
        return did, json.loads(text)
    except json.JSONDecodeError as e:
        return dead_letter(path, BAD_JSON, str(e), row=row, line=line, doc_id=did)


def jsonl_records(
    path: str, doc_id: str, *, split: Split | None = None, pos: Position | None = None
) -> Iterator[tuple[int, str, object] | dict]:
    """(row, doc id, parsed value) of every record of a jsonl file or byte range: blank lines
    skipped, a line that is not UTF-8 or not JSON as a dead letter (a dict; a record is a tuple).
    Shared by the text reader (`read_jsonl`) and the conversation reader (`chat_read`)."""
    for row, raw in _jsonl_lines(path, split or Split(), pos or Position()):
        record = _jsonl_record(path, doc_id, row, raw)
        # the raw line would stay alive while the record is processed downstream (this
        # generator waits at the yield): an extra copy of a 40 MB document
        raw = None
        if record is None:
            continue
        yield record if isinstance(record, dict) else (row, *record)


def read_jsonl(
    path: str,
    doc_id: str,
    *,
    field: str = "text",
    split: Split | None = None,
    pos: Position | None = None,
) -> Iterator[Doc | dict]:
    """The documents of a jsonl file or byte range. The common line (a JSON object with a
    non-blank string at a top-level `field`) takes one parse and no checks in Python: on short
    documents (a verse per line) those checks cost as much as the parse. Any other line goes
    through `_text_or_dead`, which names what is wrong with it."""
    top = field if "." not in field else None
    loads = json.loads
    for row, raw in _jsonl_lines(path, split or Split(), pos or Position()):
        if top is not None:
            try:
                value = loads(raw.decode("utf-8"))[top]
            except Exception:  # noqa: BLE001 - any irregular line: `_text_or_dead` says what
                value = None
            if type(value) is str and value.strip():
                raw = None  # the document's text is all that stays alive downstream
                yield Doc(f"{doc_id}:{row}", value, path)
                continue
            value = None
        out = _text_or_dead(path, doc_id, row, raw, field=field)
        raw = None
        if out is not None:
            yield out


def _text_or_dead(path: str, doc_id: str, row: int, raw: bytes, *, field: str) -> Doc | dict | None:
    """One jsonl line -> its `Doc`, its dead letter, or None (a blank line)."""
    record = _jsonl_record(path, doc_id, row, raw)
    if record is None or isinstance(record, dict):
        return record  # blank, or a dead letter
    did, obj = record
    line = row + 1
    try:
        value = _get_field(obj, field)
    except KeyError:
        keys = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
        return dead_letter(
            path,
            MISSING_FIELD,
            f"no field {field!r} (found {keys})",
            row=row,
            line=line,
            field=field,
            doc_id=did,
        )
    if not isinstance(value, str):
        return dead_letter(
            path,
            BAD_FIELD_TYPE,
            f"field {field!r} is {type(value).__name__}, expected a string",
            row=row,
            line=line,
            field=field,
            doc_id=did,
        )
    return _doc_or_empty(path, did, value, row=row, line=line, field=field)


def read_parquet(path: str, doc_id: str, *, column: str = "text") -> Iterator[Doc | dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open(path, binary_seekable=True) as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if column not in names:
            yield dead_letter(
                path, MISSING_FIELD, f"no column {column!r} (found {names[:10]})", field=column
            )
            return
        ctype = pf.schema_arrow.field(column).type
        if not (pa.types.is_string(ctype) or pa.types.is_large_string(ctype)) and not (
            pa.types.is_binary(ctype) or pa.types.is_large_binary(ctype)
        ):
            yield dead_letter(
                path, BAD_FIELD_TYPE, f"column {column!r} is {ctype}, expected string", field=column
            )
            return
        row = 0
        for batch in pf.iter_batches(columns=[column], batch_size=4096):
            for value in batch.column(0).to_pylist():
                did = f"{doc_id}:{row}"
                if value is None:
                    yield dead_letter(
                        path, EMPTY_DOCUMENT, "null value", row=row, field=column, doc_id=did
                    )
                else:
                    if isinstance(value, bytes):
                        value, bad = _decode(value, file=path, doc_id=did, row=row, line=None)
                        if bad is not None:
                            yield {**bad, "field": column}
                            row += 1
                            continue
                    yield _doc_or_empty(path, did, value, row=row, field=column)
                row += 1


def read_file(
    path: str,
    doc_id: str,
    config: ReaderConfig,
    *,
    split: Split | None = None,
    pos: Position | None = None,
) -> Iterator[Doc | dict]:
    """All documents (and dead letters) of one file, or of one `Split` of a jsonl file. Never
    raises on bad input: an error while opening or reading it (after some documents, perhaps)
    ends the file with a dead letter. `pos` counts bytes as they are read (jsonl) or when the
    file is done (txt, parquet: read whole)."""
    fmt = file_format(path)
    if fmt is None:
        yield dead_letter(
            path,
            UNKNOWN_FORMAT,
            "unknown file type: expected "
            f"{TXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES} (optionally compressed)",
            doc_id=doc_id,
        )
        return
    if fmt == "txt":
        gen = read_txt(path, doc_id, mode=config.txt_mode)
    elif fmt == "jsonl":
        gen = read_jsonl(path, doc_id, field=config.text_field, split=split, pos=pos)
    else:
        gen = read_parquet(path, doc_id, column=config.text_field)
    try:
        yield from gen
    except Exception as e:  # noqa: BLE001 - any failure to read a file is that file's dead letter
        yield dead_letter(path, UNREADABLE_FILE, f"{type(e).__name__}: {e}", doc_id=doc_id)


def doc_ids_for(paths: list[str], bases: list[str]) -> dict[str, str]:
    """Short, unique document id prefixes: each path relative to its pattern's base directory,
    or the full path where two relative names would collide."""
    rel = {}
    for p, base in zip(paths, bases):
        b = base.rstrip("/")
        rel[p] = p[len(b) + 1 :] if b and p.startswith(b + "/") else p
    seen: dict[str, int] = {}
    for r in rel.values():
        seen[r] = seen.get(r, 0) + 1
    return {p: (r if seen[r] == 1 else p) for p, r in rel.items()}


def glob_base(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: "data/*/x.jsonl" -> "data"."""
    cut = min((i for i, c in enumerate(pattern) if c in "*?["), default=len(pattern))
    head = pattern[:cut]
    return head.rsplit("/", 1)[0] if "/" in head else ""


def splittable(path: str) -> bool:
    """Only uncompressed local jsonl: one seek per range, and rows are lines."""
    name = PurePosixPath(path).name.lower()
    return "://" not in path and name.endswith(JSONL_SUFFIXES)


def plan_splits(path: str, size: int, split_bytes: int) -> list[Split]:
    """Byte ranges of about `split_bytes` cut at line starts, each with the row number of its
    first line (one streaming pass counting newlines; memory stays one block)."""
    if size <= split_bytes:
        return [Split(0, None, 0)]
    # equal ranges, not full ones and a remainder: runners deal tasks round-robin, and a
    # small last range per file put every file's large first range on the same worker
    n = -(-size // split_bytes)
    targets = [size * i // n for i in range(1, n)]
    starts, rows = [0], [0]
    block_at, newlines, t = 0, 0, 0
    with open(path, "rb") as f:
        while t < len(targets):
            block = f.read(16 << 20)
            if not block:
                break
            lo = 0
            while t < len(targets):
                want = max(targets[t], starts[-1] + 1) - block_at
                i = block.find(b"\n", max(want, lo))
                if i < 0:
                    break
                newlines += block.count(b"\n", lo, i + 1)
                lo = i + 1
                if block_at + lo < size:
                    starts.append(block_at + lo)
                    rows.append(newlines)
                t += 1
            newlines += block.count(b"\n", lo)
            block_at += len(block)
    ends = [*starts[1:], None]
    return [Split(s, e, r) for s, e, r in zip(starts, ends, rows)]
