"""Shards in an object store read one file at a time (``data.stream=true``), for datasets
larger than a node's disk.

`prepare` fetches only the marker, stats.json and, per shard file, an index of its ``doc_id``
and ``window`` columns (ranged reads), which is all the held-out split and the row count need.
`StreamedFiles.path` then hands a reader each file's local copy, verified while it downloads,
fetches the next in the background (rows are read in file order) and evicts the least recently
used beyond ``keep_files``; the processes of a node share the entry, so a file crosses the
network once per node while it stays in the window (README, "Object storage and runners").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa

from tokenbridge import urls
from tokenbridge.formats import checksums, shard_schema
from tokenbridge.remote_cache import (
    LOCKS,
    download,
    entry_name,
    errors,
    filesystem,
    locked,
    read_marker_url,
)

STREAM = ".stream.json"  # the entry's commit point: written once the index is complete
INDEX = ".index"  # one Arrow file per shard file: doc_id, window, the shard schema's metadata
INDEX_COLUMNS = ("doc_id", "window")
DOWNLOADS = ".downloads"  # one line per file downloaded on this node: "name bytes"
RANGE_BYTES = 1 << 18  # ranged reads of the index columns: small blocks, not s3fs's 5 MB


def entry_of(url: str, root: Path) -> Path:
    """The streamed entry of `url`: beside a whole copy's entry, never the same directory."""
    return root / f"{entry_name(url)}-stream"


def prepare(url: str, root: str | os.PathLike, *, keep_files: int) -> Path:
    """The local entry of the shard directory `url` (marker, stats.json, per-file index; no
    data file), made once per node: every process may call it, one makes it."""
    root = Path(root)
    entry = entry_of(url, root)
    (root / LOCKS).mkdir(parents=True, exist_ok=True)
    with locked(root / LOCKS / entry.name):
        if (entry / STREAM).is_file():
            return entry
        shutil.rmtree(entry, ignore_errors=True)  # one that died half way
        (entry / INDEX).mkdir(parents=True)
        raw, marker = read_marker_url(url, shard_schema.COMPLETED_MARKER)
        sums = marker.get("checksums", {})
        if shard_schema.STATS_FILE in sums:
            download(
                urls.join(url, shard_schema.STATS_FILE),
                entry / shard_schema.STATS_FILE,
                expected=sums[shard_schema.STATS_FILE],
            )
        for name, rows in sorted(marker["files"].items()):
            index = _index(urls.join(url, name))
            if index.num_rows != int(rows):
                raise ValueError(
                    f"{urls.join(url, name)}: {index.num_rows} rows, {shard_schema.COMPLETED_MARKER} says {rows}"
                )
            path = str(entry / INDEX / name)
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, index.schema) as w:
                w.write_table(index)
        (entry / shard_schema.COMPLETED_MARKER).write_bytes(raw)
        checksums.write_json_atomic(entry / STREAM, {"url": url, "keep_files": int(keep_files)})
    return entry


def _index(url: str) -> pa.Table:
    """The ``doc_id`` and ``window`` columns of the shard object `url`, with its schema's
    metadata, read by ranges (its footer, then those columns' buffers)."""
    fs = filesystem()
    with errors(url, "a read"), fs.open(urls.store_key(url), "rb", block_size=RANGE_BYTES) as f:
        schema = pa.ipc.open_file(f).schema
        missing = [c for c in INDEX_COLUMNS if schema.get_field_index(c) < 0]
        if missing:
            raise ValueError(f"{url}: not a shard file (no column {missing})")
        opts = pa.ipc.IpcReadOptions(
            included_fields=[schema.get_field_index(c) for c in INDEX_COLUMNS]
        )
        table = pa.ipc.open_file(f, options=opts).read_all()
    # the schema's metadata rides along, so the tokenizer checks run as for local shards
    return table.replace_schema_metadata(schema.metadata)


def is_streamed(d: str | os.PathLike) -> bool:
    return (Path(d) / STREAM).is_file()


class StreamedFiles:
    """The data files of a prepared entry, fetched as a reader reaches them, the next one in
    the background, at most `keep` on disk."""

    def __init__(self, entry: Path, names: list[str], sums: dict[str, dict]):
        info = json.loads((entry / STREAM).read_text())
        self.entry, self.url, self.keep = entry, info["url"], max(2, int(info["keep_files"]))
        self.names, self.sums = names, sums
        self.downloads = 0  # files this process downloaded (tests; a log line at the end)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenbridge-prefetch")
        self._next: dict[str, object] = {}  # name -> its background fetch
        # the files the reader will read, in order (the stream's training rows; default all):
        # what comes after the current one is fetched ahead, a file of held-out rows is not
        self.order = list(range(len(names)))
        self._keep: set[str] = set()  # the current file and the next: never evicted

    def index(self, f: int) -> pa.Table:
        """Shard file `f`'s ``doc_id`` and ``window`` columns (local, small)."""
        return pa.ipc.open_file(pa.memory_map(str(self.entry / INDEX / self.names[f]))).read_all()

    def path(self, f: int) -> Path:
        """The local copy of shard file `f` (fetched now if it is not there), its successor
        fetched in the background, the least recently used beyond `keep` deleted."""
        name = self.names[f]
        pending = self._next.pop(name, None)
        if pending is not None:
            pending.result()  # raises what the background fetch raised
        p = self._ensure(name)
        os.utime(p)  # its last use: what the window evicts by
        later = [g for g in self.order if g > f] or self.order  # the next one, or wrap around
        nxt = self.names[later[0]] if later else name
        self._keep = {name, nxt}
        # room for the next one before it arrives: at most `keep` files on disk at any time
        self._evict(room=0 if (self.entry / nxt).is_file() else 1)
        if nxt != name and nxt not in self._next and not (self.entry / nxt).is_file():
            self._next[nxt] = self._pool.submit(self._ensure, nxt)
        return p

    def touch(self, f: int) -> None:
        """A row of file `f` was read from its mapping: its last use (if it is still here)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.entry / self.names[f])

    def _ensure(self, name: str) -> Path:
        p = self.entry / name
        if p.is_file():
            return p
        with locked(self.entry / INDEX / f".{name}.lock"):  # one download per node
            if not p.is_file():
                download(urls.join(self.url, name), p, expected=self.sums.get(name))
                with self._lock:
                    self.downloads += 1
                # the node's record of every download (any process): what a file cost again
                with open(self.entry / DOWNLOADS, "a") as log:
                    log.write(f"{name} {p.stat().st_size}\n")
        return p

    def _evict(self, *, room: int) -> None:
        """Delete the least recently used files (never the current or the next one) until
        `room` more fit in the window."""
        local = [self.entry / n for n in self.names if (self.entry / n).is_file()]
        extra = len(local) + room - self.keep
        # a file a reader still maps stays readable after its deletion (POSIX); one needed
        # again later (the next epoch, a shuffle buffer reaching back) is fetched again
        for p in sorted((p for p in local if p.name not in self._keep), key=_mtime)[:extra]:
            p.unlink(missing_ok=True)

    def local_files(self) -> list[str]:
        return [n for n in self.names if (self.entry / n).is_file()]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except FileNotFoundError:
        return float("inf")
