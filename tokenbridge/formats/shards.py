"""Aligned shard directories: write Arrow IPC shards atomically, read them back only when complete.

Shards are Arrow IPC *files*, so a reader memory-maps them and jumps to any record batch. Every
file is written under a temporary name and renamed, and ``COMPLETED``, written last, lists the
shard files with their rows and checksums: a directory that looks complete is complete, and
stale files of a crashed run are never picked up. The reader refuses what the trainer must not
read (no marker, another schema version or tokenizer, a damaged file: docs/integrity.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from tokenbridge import atomic
from tokenbridge.formats import checksums, shard_schema

# the marker writers below take a `checksums=` argument, which hides the module inside them
from tokenbridge.formats.checksums import HASH, entry, hash_file, new_hash

if TYPE_CHECKING:
    from tokenbridge.alignment import Window

COMPLETED_VERSION = 3
READABLE_COMPLETED_VERSIONS = (1, 2, 3)
KIND = "shards"  # the marker's kind, for `tokenbridge.commands.verify`


class IncompleteShardsError(RuntimeError):
    """The directory has no COMPLETED marker (a run still going, or one that crashed)."""


class FingerprintMismatchError(ValueError):
    """The shards were made with other tokenizers than the ones the caller uses."""


def shard_name(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}{shard_schema.SHARD_SUFFIX}"


def window_to_row(doc_id: str, w: Window) -> dict:
    """One `Window` -> one row of the shard schema (column name -> value)."""
    row = {
        "doc_id": doc_id,
        "window": int(w.window),
        "char_start": int(w.char_start),
        "char_end": int(w.char_end),
        "text": w.text,
        "student_ids": np.asarray(w.student_ids, dtype=np.int32),
    }
    for i, ids in enumerate(w.teacher_ids):
        row[shard_schema.teacher_ids_column(i)] = np.asarray(ids, dtype=np.int32)
        row[shard_schema.teacher_chunk_column(i)] = np.asarray(w.teacher_chunk[i], dtype=np.int32)
        row[shard_schema.teacher_student_chunk_column(i)] = np.asarray(
            w.teacher_student_chunk[i], dtype=np.int32
        )
        row[shard_schema.teacher_n_chunks_column(i)] = int(w.teacher_n_chunks[i])
    return row


def _list_array(values: list[np.ndarray]) -> pa.Array:
    """list<int32> from many int32 arrays in one copy (no per-element Python conversion)."""
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(values).astype(np.int32, copy=False) if values else np.zeros(0, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.int32()))


def rows_to_batch(rows: list[dict], schema: pa.Schema) -> pa.RecordBatch:
    """Rows as made by `window_to_row` -> one RecordBatch of `schema` (missing column = error)."""
    arrays = []
    for field in schema:
        try:
            values = [r[field.name] for r in rows]
        except KeyError:
            raise ValueError(f"row is missing column {field.name!r} of the shard schema") from None
        if pa.types.is_list(field.type):
            arrays.append(_list_array(values))
        else:
            arrays.append(pa.array(values, type=field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def windows_to_batch(items: list[tuple[str, Window]], schema: pa.Schema) -> pa.RecordBatch:
    """(doc_id, Window) pairs -> one RecordBatch, column by column (no per-row dicts): the
    same batch as `rows_to_batch` over `window_to_row`, at a fraction of the Python work."""
    n_t = (len(schema) - len(shard_schema.PROVENANCE_FIELDS) - 1) // 4
    ws = [w for _, w in items]
    cols = {
        "doc_id": pa.array([d for d, _ in items], pa.string()),
        "window": pa.array(np.fromiter((w.window for w in ws), np.int32, len(ws))),
        "char_start": pa.array(np.fromiter((w.char_start for w in ws), np.int64, len(ws))),
        "char_end": pa.array(np.fromiter((w.char_end for w in ws), np.int64, len(ws))),
        "text": pa.array([w.text for w in ws], pa.string()),
        "student_ids": _list_array([w.student_ids for w in ws]),
    }
    for i in range(n_t):
        if any(len(w.teacher_ids) != n_t for w in ws):
            raise ValueError(f"a window has teacher columns for other than {n_t} teacher(s)")
        cols[shard_schema.teacher_ids_column(i)] = _list_array([w.teacher_ids[i] for w in ws])
        cols[shard_schema.teacher_chunk_column(i)] = _list_array([w.teacher_chunk[i] for w in ws])
        cols[shard_schema.teacher_student_chunk_column(i)] = _list_array(
            [w.teacher_student_chunk[i] for w in ws]
        )
        cols[shard_schema.teacher_n_chunks_column(i)] = pa.array(
            np.fromiter((w.teacher_n_chunks[i] for w in ws), np.int32, len(ws))
        )
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


class ShardWriter:
    """Writes one Arrow IPC file atomically: rows go to a hidden temporary file, renamed on
    `close()`; an exception inside ``with`` (or `abort()`) removes the temporary file. The bytes
    are hashed on their way to the file: after `close()`, `checksum` is the file's marker entry
    (pass it to `write_completed`).

    ``with ShardWriter(path, schema) as w: w.write_rows(rows)`` or ``w.write_table(table)``.
    """

    def __init__(self, path: str | os.PathLike, schema: pa.Schema):
        self.path = Path(path)
        self.schema = schema
        self.num_rows = 0
        self.checksum: dict | None = None
        self._tmp = atomic.temp_path(self.path)
        self._file = checksums.HashingSink(self._tmp)  # closed in close()/abort()
        self._writer = pa.ipc.new_file(self._file, schema)

    def write_rows(self, rows: list[dict]) -> None:
        if rows:
            self.write_batch(rows_to_batch(rows, self.schema))

    def write_batch(self, batch: pa.RecordBatch) -> None:
        if not batch.schema.equals(self.schema, check_metadata=False):
            raise ValueError(
                f"{self.path}: batch schema differs from the shard schema:\n"
                f"{batch.schema}\nexpected\n{self.schema}"
            )
        self._writer.write_batch(batch)
        self.num_rows += batch.num_rows

    def write_table(self, table: pa.Table, *, max_chunksize: int = 1024) -> None:
        for batch in table.to_batches(max_chunksize=max_chunksize):
            self.write_batch(batch)

    def close(self) -> Path:
        self._writer.close()
        self._file.close()  # flush + fsync
        self.checksum = self._file.entry()
        atomic.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # best effort: the file is being thrown away
            self._writer.close()
        self._file.file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_dead_letters(out_dir: str | os.PathLike, records: Iterable[dict]) -> int:
    """All dead-letter records as one JSON line each, sorted for a stable file; returns count."""
    lines = sorted(json.dumps(r, sort_keys=True, ensure_ascii=False) for r in records)
    body = "".join(x + "\n" for x in lines)
    atomic.write(Path(out_dir) / shard_schema.DEAD_LETTER_FILE, body, fsync=True)
    return len(lines)


def write_completed(
    out_dir: str | os.PathLike,
    stats: dict,
    *,
    files: dict[str, int] | None = None,
    checksums: dict[str, dict] | None = None,
    kind: str = KIND,
    schema_version: int = shard_schema.SCHEMA_VERSION,
) -> None:
    """Write stats.json, then the COMPLETED marker (last, atomically).

    `files` maps shard file name -> row count; by default every ``*.arrow`` file in the directory.
    Every listed file must exist: the marker promises the directory is whole. `checksums`: file
    name -> marker entry (`tokenbridge.formats.checksums.entry`) of the files the caller wrote, as its
    writer computed them (`ShardWriter.checksum`, the rolling parts' manifests); stats.json's is
    added here. A listed shard without one is hashed here, from disk: only for callers that
    wrote it by other means (every writer in this repository passes its own).
    `kind` and `schema_version`: of the files listed (the teacher cache has its own of both;
    `tokenbridge.commands.verify` checks the values of ``kind="shards"`` files only).
    """
    out = Path(out_dir)
    if files is None:
        files = {p.name: _count_rows(p) for p in sorted(out.glob(f"*{shard_schema.SHARD_SUFFIX}"))}
    missing = [f for f in files if not (out / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{out}: COMPLETED would list missing shard files {missing}")
    sums = dict(checksums or {})
    for name in files:
        if name not in sums:
            sums[name] = hash_file(out / name)
    docs = completed_documents(
        stats, files=files, checksums=sums, kind=kind, schema_version=schema_version
    )
    atomic.write(out / shard_schema.STATS_FILE, docs[shard_schema.STATS_FILE], fsync=True)
    atomic.write(
        out / shard_schema.COMPLETED_MARKER, docs[shard_schema.COMPLETED_MARKER], fsync=True
    )


def completed_documents(
    stats: dict,
    *,
    files: dict[str, int],
    checksums: dict[str, dict],
    kind: str = KIND,
    schema_version: int = shard_schema.SCHEMA_VERSION,
) -> dict[str, bytes]:
    """The bytes of stats.json and of the COMPLETED marker that lists `files` (name -> rows)
    with `checksums` (name -> entry, one per listed file) and stats.json's own: what
    `write_completed` writes, for writers that store them elsewhere (an object store)."""
    stats_bytes = (json.dumps(stats, indent=2, sort_keys=True) + "\n").encode()
    sums = dict(checksums)
    h = new_hash()
    h.update(stats_bytes)
    sums[shard_schema.STATS_FILE] = entry(len(stats_bytes), h.hexdigest())
    marker = {
        "version": COMPLETED_VERSION,
        "kind": kind,
        "schema_version": schema_version,
        "files": dict(sorted(files.items())),
        "num_rows": int(sum(files.values())),
        "hash": HASH,
        "checksums": dict(sorted(sums.items())),
    }
    return {
        shard_schema.STATS_FILE: stats_bytes,
        shard_schema.COMPLETED_MARKER: (json.dumps(marker, indent=2) + "\n").encode(),
    }


def _count_rows(path: Path) -> int:
    with pa.memory_map(str(path), "r") as src:
        r = pa.ipc.open_file(src)
        return sum(r.get_batch(i).num_rows for i in range(r.num_record_batches))


def _check_tokenizer(
    role: str, found: shard_schema.TokenizerInfo, want: shard_schema.TokenizerInfo, where: str
) -> None:
    if found.fingerprint != want.fingerprint:
        raise FingerprintMismatchError(
            f"{where}: {role} tokenizer fingerprint {found.fingerprint[:16]}... "
            f"({found.name}, vocab {found.vocab_size}) but the caller uses "
            f"{want.fingerprint[:16]}... ({want.name}, vocab {want.vocab_size}); "
            "re-run the align job with these tokenizers"
        )


@dataclass
class ShardSet:
    """A complete shard directory: its metadata, files and row count."""

    dir: Path
    meta: shard_schema.ShardMeta
    files: list[Path]
    num_rows: int
    file_rows: list[int]
    checksums: dict[str, dict] = dataclasses.field(default_factory=dict)  # name -> entry
    verify: str = "first_open"  # checksums.VERIFY_MODES
    # data.stream: the files are fetched as a reader reaches them (`streamed_shards`)
    stream: object | None = None

    def check_file(self, path: Path) -> None:
        """Verify `path` against the marker unless `verify` is never (or the marker, of version
        1, has no checksum): once per process (`checksums.verify_once`)."""
        e = self.checksums.get(path.name)
        if self.verify != "never" and e is not None:
            checksums.verify_once(path, e, hint=_REBUILD)

    def read_table(self, path: Path) -> pa.Table:
        """The whole file as a table memory-mapped (zero-copy), its checksum verified first."""
        self.check_file(path)
        with _arrow_errors(path, self.checksums.get(path.name)):
            return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()

    def iter_batches(self, *, files: list[Path] | None = None) -> Iterator[pa.RecordBatch]:
        """Record batches of `files` (default: all), memory-mapped, in file order."""
        for path in self.files if files is None else files:
            self.check_file(path)
            expected = self.checksums.get(path.name)
            with _arrow_errors(path, expected), pa.memory_map(str(path), "r") as src:
                reader = pa.ipc.open_file(src)
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            yield from batches

    def table(self) -> pa.Table:
        batches = list(self.iter_batches())
        return pa.Table.from_batches(batches, schema=self.schema)

    @property
    def schema(self) -> pa.Schema:
        if self.files:  # the files' own (a version-1 directory read by this code is version 1)
            with pa.memory_map(str(self.files[0]), "r") as src:
                return pa.ipc.open_file(src).schema
        return shard_schema.shard_schema(self.meta.student, self.meta.teachers, chat=self.meta.chat)

    def stats(self) -> dict:
        return json.loads((self.dir / shard_schema.STATS_FILE).read_text())


_REBUILD = "re-copy it or re-run the align job (`python -m tokenbridge.commands.verify DIR` checks them all)"


@contextlib.contextmanager
def _arrow_errors(path: Path, expected: dict | None):
    """Arrow's errors on a file (raw ``OSError: Read out of bounds``, ...) as one line naming
    it; when its checksum is known and differs, the `DamagedFileError` that says so instead."""
    try:
        yield
    except (pa.ArrowException, OSError) as e:
        if expected is not None:
            checksums.verify_file(path, expected, hint=_REBUILD)
        raise checksums.IntegrityError(
            f"{path}: not a readable Arrow IPC file ({str(e).splitlines()[0]})"
        ) from None


def _read_marker(d: Path) -> dict:
    marker_path = d / shard_schema.COMPLETED_MARKER
    if not marker_path.is_file():
        raise IncompleteShardsError(
            f"{d}: no {shard_schema.COMPLETED_MARKER} marker; the align job that writes it did not finish "
            "(still running or crashed): re-run it"
        )
    try:
        marker = json.loads(marker_path.read_text())
        marker["files"].items()
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise IncompleteShardsError(f"{marker_path}: unreadable marker ({e})") from None
    if int(marker.get("version", 1)) not in READABLE_COMPLETED_VERSIONS:
        raise ValueError(
            f"{marker_path}: marker version {marker.get('version')}, this code reads versions "
            f"{READABLE_COMPLETED_VERSIONS}; re-run the align job with this code to rebuild it"
        )
    shard_schema.check_version(int(marker.get("schema_version", -1)), where=str(marker_path))
    return marker


def open_shards(
    dir: str | os.PathLike,
    *,
    student: shard_schema.TokenizerInfo | None = None,
    teachers: list[shard_schema.TokenizerInfo] | None = None,
    verify: str = "first_open",
) -> ShardSet:
    """Open a complete shard directory, refusing what the trainer must not read.

    Raises `IncompleteShardsError` without COMPLETED (or when a listed file is missing),
    ValueError on a schema version mismatch, `checksums.IntegrityError` on an unreadable or
    (`verify="preflight"`: any file; else: a file whose footer does not parse) damaged shard,
    and `FingerprintMismatchError` when `student` / `teachers` (in order) differ from the ones
    recorded in the shards. Only the files' footers and batch headers are read here.
    """
    checksums.check_verify_mode(verify)
    d = Path(dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such shard directory")
    marker = _read_marker(d)
    listed, sums = marker["files"], marker.get("checksums", {})
    from tokenbridge.formats import streamed_shards

    if streamed_shards.is_streamed(d):  # the data files come later, one at a time
        return _open_streamed(d, marker, student=student, teachers=teachers, verify=verify)
    files = [d / name for name in sorted(listed)]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise IncompleteShardsError(
            f"{d}: {shard_schema.COMPLETED_MARKER} lists missing files {missing}"
        )
    if verify == "preflight":  # what a reader reads (the dead letters are the verify command's)
        for name in sorted(n for n in sums if n in listed or n == shard_schema.STATS_FILE):
            checksums.verify_once(d / name, sums[name], hint=_REBUILD)
    meta: shard_schema.ShardMeta | None = None
    file_rows = []
    for path in files:
        with _arrow_errors(path, sums.get(path.name)), pa.memory_map(str(path), "r") as src:
            reader = pa.ipc.open_file(src)
            m = shard_schema.read_meta(reader.schema, where=str(path))
            rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        if rows != int(listed[path.name]):
            raise ValueError(
                f"{path}: {rows} rows, {shard_schema.COMPLETED_MARKER} says {listed[path.name]}"
            )
        if meta is None:
            meta = m
        elif m != meta:
            raise ValueError(f"{path}: tokenizer metadata differs from {files[0].name}")
        file_rows.append(rows)
    return _checked(d, meta, marker, files, file_rows, student=student, teachers=teachers,
                    verify=verify)  # fmt: skip


def _open_streamed(d: Path, marker: dict, *, student, teachers, verify: str) -> ShardSet:
    """A streamed entry (`tokenbridge.formats.streamed_shards`): metadata and row counts from its
    per-file indexes and marker; the files themselves are fetched by `ShardSet.stream`."""
    from tokenbridge.formats.streamed_shards import INDEX, StreamedFiles

    names = sorted(marker["files"])
    meta = None
    for name in names:
        with pa.memory_map(str(d / INDEX / name), "r") as src:
            m = shard_schema.read_meta(pa.ipc.open_file(src).schema, where=f"{d}/{name}")
        if meta is None:
            meta = m
        elif m != meta:
            raise ValueError(f"{d}/{name}: tokenizer metadata differs from {names[0]}")
    rows = [int(marker["files"][n]) for n in names]
    out = _checked(d, meta, marker, [d / n for n in names], rows, student=student,
                   teachers=teachers, verify=verify)  # fmt: skip
    out.stream = StreamedFiles(d, names, marker.get("checksums", {}))
    return out


def _checked(d, meta, marker, files, file_rows, *, student, teachers, verify) -> ShardSet:
    """The `ShardSet`, its metadata checked against the caller's tokenizers."""
    sums = marker.get("checksums", {})
    if meta is None:  # an empty run: nothing aligned, metadata from stats.json
        stats = json.loads((d / shard_schema.STATS_FILE).read_text())
        meta = shard_schema.ShardMeta(
            int(marker["schema_version"]),
            shard_schema.TokenizerInfo.from_json(stats["student"]),
            [shard_schema.TokenizerInfo.from_json(t) for t in stats["teachers"]],
            stats.get("chat_meta"),
        )
    if student is not None:
        _check_tokenizer("student", meta.student, student, str(d))
    if teachers is not None:
        if len(teachers) != len(meta.teachers):
            raise FingerprintMismatchError(
                f"{d}: shards have {len(meta.teachers)} teacher(s) "
                f"({[t.name for t in meta.teachers]}), the caller uses {len(teachers)}"
            )
        for i, (found, want) in enumerate(zip(meta.teachers, teachers)):
            _check_tokenizer(f"teacher {i}", found, want, str(d))
    return ShardSet(d, meta, files, int(sum(file_rows)), file_rows, sums, verify)
