"""Open a teacher cache for training: refuse what must not be read, join its rows to the shards.

`open_cache` checks, before anything trains: the marker, the versions, every listed file, then
the caller's expectations (`Expected`: shards, teacher column, tokenizer and weights, compute
dtype), and finally the join: every shard row must be scored exactly once (a cache with dead
letters is refused, naming them). Files are hashed at open unless ``verify="never"``, since the
join reads them all (docs/integrity.md). `CacheSet.read` then maps one row's outputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tokenbridge.formats import checksums, shard_schema, shards, teacher_cache
from tokenbridge.formats.fingerprints import shards_fingerprint

REBUILD = "rebuild it with `make teacher-cache SHARDS=<the shards> TEACHER=<the teacher>`"


class IncompleteCacheError(RuntimeError):
    """No COMPLETED marker (the job is running or crashed), or a listed file is missing."""


class CacheMismatchError(ValueError):
    """The cache was built for other shards, another teacher, or other outputs."""


@dataclass(frozen=True)
class Expected:
    """What the trainer will use the cache with (None: not checked)."""

    shards: shards.ShardSet
    teacher_index: int
    tokenizer: shard_schema.TokenizerInfo | None = None
    weights: str | None = None
    dtype: str | None = None
    where: str = "teacher cache"  # how messages name the config entry, e.g. teachers[0].cache


@dataclass
class CachedRow:
    """One row's stored outputs, decoded (U teacher positions, K top-k)."""

    topk_ids: np.ndarray  # int64 [U, K], -1 where the log-prob is -inf
    topk_logprobs: np.ndarray  # fp32 [U, K]
    tail_logprob: np.ndarray  # fp32 [U]
    target_logprob: np.ndarray | None  # fp32 [U]


class CacheSet:
    """A complete, checked cache joined to a shard set (see `open_cache`). Each file stays a
    memory-mapped Arrow reader; a record batch is fetched (zero-copy) when a row of it is read,
    so an open cache holds per file only its batches' row offsets, plus the join."""

    def __init__(
        self, directory: Path, meta: teacher_cache.CacheMeta, files: list[Path], stats: dict
    ):
        self.dir, self.meta, self.files, self.stats = directory, meta, files, stats
        self.readers: list[pa.ipc.RecordBatchFileReader] = []
        self.batch_starts: list[np.ndarray] = []
        for path in files:
            try:
                reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
                found = teacher_cache.read_file_meta(reader.schema, where=str(path))
                sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
            except pa.ArrowInvalid as e:
                raise ValueError(f"{path}: not a readable Arrow IPC file ({e})") from None
            if found != meta:
                raise CacheMismatchError(
                    f"{path}: its metadata differs from {directory}/stats.json"
                )
            self.readers.append(reader)
            self.batch_starts.append(np.cumsum([0, *sizes]))
        self.file_of = np.zeros(0, np.int32)  # per global shard row: cache file
        self.row_of = np.zeros(0, np.int32)  # ... and row in it

    def file_rows(self, f: int) -> int:
        return int(self.batch_starts[f][-1])

    def batches(self, f: int):
        for i in range(self.readers[f].num_record_batches):
            yield self.readers[f].get_batch(i)

    def _locate(self, f: int, r: int) -> tuple[pa.RecordBatch, int]:
        b = int(np.searchsorted(self.batch_starts[f], r, side="right") - 1)
        return self.readers[f].get_batch(b), r - int(self.batch_starts[f][b])

    def read(self, row: int) -> CachedRow:
        """The outputs stored for global shard row `row`."""
        f, r = int(self.file_of[row]), int(self.row_of[row])
        batch, i = self._locate(f, r)
        meta = self.meta

        def values(name: str) -> np.ndarray:
            return batch.column(name)[i].values.to_numpy(zero_copy_only=False)

        # copies (U values each): the arrays handed out must not be views of a read-only map
        tail = values("tail_logprob").astype(np.float32, copy=True)
        u = tail.shape[0]
        lp = teacher_cache.decode_logprobs(values("topk_logprobs"), meta.logprob_dtype).reshape(
            u, meta.k
        )
        ids = teacher_cache.unpack_ids(
            batch.column("topk_ids")[i].as_buffer(), meta.id_bits, u * meta.k
        )
        ids = np.where(lp > -np.inf, ids.reshape(u, meta.k), -1)
        target = values("target_logprob").astype(np.float32, copy=True) if meta.target else None
        return CachedRow(ids, lp, tail, target)

    def read_samples(self, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The R ids drawn per position for global shard `row` (a cache built with
        ``--samples R``): ``(n [U], ids [sum n], counts [sum n])``, position after position the
        distinct ids drawn, ascending, and how often each was drawn (counts / R estimates the
        teacher's distribution at the temperature without bias)."""
        if not self.meta.samples:
            raise ValueError(f"{self.dir}: built without sampled ids (--samples R)")
        f, r = int(self.file_of[row]), int(self.row_of[row])
        batch, i = self._locate(f, r)
        n = batch.column("sample_n")[i].values.to_numpy(zero_copy_only=False).astype(np.int64)
        counts = batch.column("sample_counts")[i].values.to_numpy(zero_copy_only=False)
        buf = batch.column("sample_ids")[i].as_buffer()
        ids = teacher_cache.unpack_ids(buf, self.meta.id_bits, int(n.sum()))
        return n, ids, counts.astype(np.int64)

    def where(self, row: int) -> str:
        f, r = int(self.file_of[row]), int(self.row_of[row])
        return f"{self.files[f]} row {r}"


def _marker(d: Path) -> dict:
    path = d / shard_schema.COMPLETED_MARKER
    if not path.is_file():
        raise IncompleteCacheError(
            f"{d}: no {shard_schema.COMPLETED_MARKER} marker: the teacher-cache job that writes it last did "
            f"not finish (still running, or crashed); {REBUILD}"
        )
    try:
        marker = json.loads(path.read_text())
        marker["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise IncompleteCacheError(f"{path}: unreadable marker ({e})") from None
    if int(marker.get("version", 1)) not in shards.READABLE_COMPLETED_VERSIONS:
        raise ValueError(f"{path}: marker version {marker.get('version')} is not readable here")
    return marker


def _check(found, want, what: str, where: str, d: Path) -> None:
    if want is not None and found != want:
        raise CacheMismatchError(
            f"{where}={d}: built with {what} {found}, the run uses {want}; {REBUILD}, "
            "or point the config at the cache built for these"
        )


def check_expected(meta: teacher_cache.CacheMeta, exp: Expected, d: Path) -> None:
    """CacheMismatchError unless `meta` was built for what `exp` describes."""
    w = exp.where
    files = {p.name: int(n) for p, n in zip(exp.shards.files, exp.shards.file_rows)}
    if meta.shards.get("files") != files:
        ours, theirs = set(files.items()), set(meta.shards.get("files", {}).items())
        diff = sorted({name for name, _ in ours ^ theirs})[:3]
        raise CacheMismatchError(
            f"{w}={d}: built from other shards than {exp.shards.dir} (files or row counts "
            f"differ: {diff}); {REBUILD}"
        )
    _check(meta.shards.get("fingerprint"), shards_fingerprint(exp.shards), "shards", w, d)
    _check(int(meta.shards.get("teacher_index", -1)), exp.teacher_index, "teacher column", w, d)
    if exp.tokenizer is not None:
        _check(meta.teacher["tokenizer"], exp.tokenizer.fingerprint, "tokenizer", w, d)
    _check(meta.teacher["weights"], exp.weights, "teacher weights", w, d)
    _check(meta.teacher["dtype"], exp.dtype, "teacher dtype", w, d)


def _join(cs: CacheSet, shard_set: shards.ShardSet, d: Path) -> None:
    """Per global shard row, the cache file and row that score it (each exactly once)."""
    names = [p.name for p in shard_set.files]
    starts = np.concatenate([[0], np.cumsum(shard_set.file_rows)]).astype(np.int64)
    n = int(starts[-1])
    file_of = np.full(n, -1, np.int32)
    row_of = np.zeros(n, np.int32)
    for f in range(len(cs.files)):
        at = 0
        for b in cs.batches(f):
            idx = pc.index_in(b.column("shard_file"), value_set=pa.array(names, pa.string()))
            if idx.null_count:
                raise CacheMismatchError(
                    f"{cs.files[f]}: rows of shard files that {shard_set.dir} does not have"
                )
            code = idx.to_numpy().astype(np.int64)
            rows = b.column("row").to_numpy().astype(np.int64)
            sizes = starts[code + 1] - starts[code]
            if ((rows < 0) | (rows >= sizes)).any():
                raise CacheMismatchError(f"{cs.files[f]}: a row number past its shard file's end")
            g = starts[code] + rows
            if (file_of[g] >= 0).any() or len(np.unique(g)) != len(g):
                raise CacheMismatchError(f"{cs.files[f]}: a shard row is scored twice")
            file_of[g] = f
            row_of[g] = at + np.arange(b.num_rows)
            at += b.num_rows
    missing = np.flatnonzero(file_of < 0)
    if missing.size:
        first = int(missing[0])
        f = int(np.searchsorted(starts, first, side="right") - 1)
        dead = cs.stats.get("dead_letters", 0)
        raise IncompleteCacheError(
            f"{d}: {missing.size} of {n} shard rows have no cached outputs (first: "
            f"{names[f]} row {first - int(starts[f])}); the job sent {dead} rows to "
            f"{shard_schema.DEAD_LETTER_FILE}: fix those rows and {REBUILD}"
        )
    cs.file_of, cs.row_of = file_of, row_of


def open_cache(
    directory: str | os.PathLike, expected: Expected, *, verify: str = "first_open"
) -> CacheSet:
    """A complete cache built for `expected`, joined to its shards (see the module docstring;
    `verify`: one of `checksums.VERIFY_MODES`)."""
    checksums.check_verify_mode(verify)
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"{expected.where}={d}: no such cache directory; {REBUILD}")
    marker = _marker(d)
    if int(marker.get("schema_version", -1)) != teacher_cache.CACHE_SCHEMA_VERSION:
        raise ValueError(
            f"{d}: teacher cache version {marker.get('schema_version')}, this code reads "
            f"version {teacher_cache.CACHE_SCHEMA_VERSION}; {REBUILD}"
        )
    sums = marker.get("checksums", {})
    if (
        verify != "never" and shard_schema.STATS_FILE in sums
    ):  # it holds the CacheMeta checked below
        checksums.verify_once(
            d / shard_schema.STATS_FILE, sums[shard_schema.STATS_FILE], hint=REBUILD
        )
    stats = json.loads((d / shard_schema.STATS_FILE).read_text())
    if stats.get("kind") != teacher_cache.KIND:
        raise ValueError(f"{d}: not a teacher cache (stats.json kind {stats.get('kind')!r})")
    meta = teacher_cache.CacheMeta.from_json(stats["cache"])
    files = [d / name for name in sorted(marker["files"])]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise IncompleteCacheError(
            f"{d}: {shard_schema.COMPLETED_MARKER} lists missing files {missing}"
        )
    check_expected(meta, expected, d)
    if verify != "never":
        for path in files:
            if path.name in sums:  # a marker of version 1 has none
                checksums.verify_once(path, sums[path.name], hint=REBUILD)
    cs = CacheSet(d, meta, files, stats)
    for f, path in enumerate(files):
        listed = int(marker["files"][path.name])
        if cs.file_rows(f) != listed:
            raise ValueError(
                f"{path}: {cs.file_rows(f)} rows, {shard_schema.COMPLETED_MARKER} says {listed}"
            )
    _join(cs, expected.shards, d)
    return cs
