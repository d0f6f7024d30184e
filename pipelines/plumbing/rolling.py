"""Rolling part files and the finalize step: streaming writes that a crash can never half-publish.

Each writer streams to part files in the run's temporary directory, hashed as they are written
and each closed with a manifest (``<part>.done``); `finalize_parts`, the only grouping, checks
the parts that committed records name, renames them into place in key order and returns the
index for COMPLETED, which the caller writes last. Local directory or object store alike
(`pipelines.plumbing.storage`); the protocol step by step: docs/pipelines.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import uuid
from pathlib import Path

import pyarrow as pa

from pipelines.plumbing import storage
from pipelines.plumbing.storage import Location
from tokenbridge import urls
from tokenbridge.formats import shard_schema, shards
from tokenbridge.formats.checksums import HashingSink

TMP_PREFIX = ".align-tmp-"
REFUSED = "refused"  # stats.json key of a run its dead letters refused (no COMPLETED)
MANIFEST_SUFFIX = ".done"
DEAD_SORT_BELOW = 64 << 20  # dead-letter files smaller than this are written sorted (stable)


def run_dir(out: Location, run_id: str) -> Location:
    return storage.join(out, f"{TMP_PREFIX}{run_id}")


def progress_dir(out: Location, run_id: str) -> str:
    """Where workers leave their progress counts (`pipelines.plumbing.progress`): the run's
    temporary directory, or, for an object store (where every flush would be an upload), a
    local temporary directory, which workers of this machine share (progress is best effort:
    workers elsewhere report none)."""
    if urls.is_url(out):
        return str(Path(tempfile.gettempdir()) / f"tokenbridge-progress-{run_id}")
    return str(storage.join(run_dir(out, run_id), "progress"))


def _write_json(path: Location, obj) -> None:
    storage.write_bytes(path, json.dumps(obj, sort_keys=True).encode())


class RollingParts:
    """Parts of one writer (one DoFn instance): ``<kind>-<writer id>-<seq><suffix>``.

    `format` "arrow": `write` takes RecordBatches (an Arrow IPC file per part, with the first
    batch's schema); "jsonl": `write` takes lists of JSON-able dicts, one line each.
    """

    def __init__(self, directory: Location, *, kind: str, fmt: str, roll_bytes: int):
        if fmt not in ("arrow", "jsonl"):
            raise ValueError(f"unknown part format {fmt!r}")
        self.dir, self.kind, self.fmt, self.roll_bytes = directory, kind, fmt, roll_bytes
        self.writer_id = uuid.uuid4().hex[:12]
        self.seq = 0
        self.sink: HashingSink | None = None
        self.arrow: pa.ipc.RecordBatchFileWriter | None = None
        self.rows = 0

    @property
    def name(self) -> str:
        suffix = shard_schema.SHARD_SUFFIX if self.fmt == "arrow" else ".jsonl"
        return f"{self.kind}-{self.writer_id}-{self.seq:05d}{suffix}"

    def write(self, data) -> str:
        """Append a batch to the current part (opening one if needed); returns its name."""
        if self.sink is None:
            path = storage.join(self.dir, self.name)
            self.sink = HashingSink(path, stream=storage.create(path))
            self.rows = 0
            if self.fmt == "arrow":
                self.arrow = pa.ipc.new_file(self.sink, data.schema)
        name = self.name
        if self.fmt == "arrow":
            self.arrow.write_batch(data)
            self.rows += data.num_rows
        else:
            lines = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in data)
            self.sink.write(lines.encode("utf-8"))
            self.rows += len(data)
        if self.sink.size >= self.roll_bytes:
            self.close()
        return name

    def close(self) -> None:
        """Finish the current part: footer, fsync, then its manifest."""
        if self.sink is None:
            return
        name = self.name
        if self.arrow is not None:
            self.arrow.close()
            self.arrow = None
        self.sink.close()
        manifest = {"rows": self.rows, **self.sink.entry()}
        _write_json(storage.join(self.dir, name + MANIFEST_SUFFIX), manifest)
        self.sink = None
        self.seq += 1

    def abort(self) -> None:
        """Drop the current part (best effort: an unreferenced part is removed anyway; an
        upload that never completes leaves no object)."""
        if self.sink is not None:
            with contextlib.suppress(Exception):
                if self.arrow is not None:
                    self.arrow.close()
                self.sink.file.close()
            with contextlib.suppress(Exception):
                storage.delete([storage.join(self.dir, self.name)])
            self.sink, self.arrow = None, None


def read_manifest(directory: Location, name: str) -> dict | None:
    """The part's manifest, or None when it has none (never closed) or a torn one. A store that
    does not answer is not a missing manifest: its error goes up as it is (ConnectionError)."""
    try:
        return json.loads(storage.read_bytes(storage.join(directory, name + MANIFEST_SUFFIX)))
    except (FileNotFoundError, ValueError):
        return None


def finalize_parts(
    out: Location, tmp: Location, parts: dict[str, dict], *, name_for
) -> dict[str, dict]:
    """Move the referenced parts into place; returns {final name: manifest + first key}.

    parts: part name -> {"rows": rows its records reported, "key": the smallest row key}.
    name_for(i, n): the final name of the i-th of n parts (in key order). Idempotent: a part
    already moved by an earlier attempt of this step is found at its final name.
    """
    order = sorted(parts, key=lambda p: (parts[p]["key"], p))
    index = {}
    for i, part in enumerate(order):
        final = name_for(i, len(order))
        src = storage.join(tmp, part)
        manifest = read_manifest(tmp, part)
        if manifest is None:
            raise RuntimeError(f"{src}: no manifest; the part was not closed")
        if int(manifest["rows"]) != int(parts[part]["rows"]):
            raise RuntimeError(
                f"{src}: {manifest['rows']} rows on disk, its batches reported "
                f"{parts[part]['rows']}"
            )
        if storage.exists(src):
            storage.rename(src, storage.join(out, final))
        elif not storage.exists(storage.join(out, final)):
            raise RuntimeError(f"{src}: referenced part is missing")
        index[final] = {**manifest, "key": parts[part]["key"]}
    return index


def concat_parts(tmp: Location, names: list[str], dest: Location, *, sort_below: int) -> dict:
    """Concatenate jsonl parts into `dest` (whole or not at all: a local file through a
    temporary name, an object in one upload); sorted lines when the total is below
    `sort_below` bytes (a stable file), in part order above. Returns its manifest."""
    parts = [storage.join(tmp, n) for n in sorted(names)]
    total = sum(storage.size(p) for p in parts)
    if total < sort_below:  # in memory, and one write (an empty file too)
        lines = sorted(line for p in parts for line in storage.read_bytes(p).splitlines(True))
        sink = HashingSink(dest, stream=io.BytesIO())
        sink.write(b"".join(lines))
        storage.write_bytes(dest, sink.file.getvalue())
        return {"rows": len(lines), **sink.entry()}
    remote = urls.is_url(dest)
    write_to = dest if remote else storage.join(tmp, f".{urls.name(dest)}.concat")
    sink = HashingSink(write_to, stream=storage.create(write_to))
    rows = 0
    try:
        for p in parts:
            with storage.open_read(p) as f:
                while block := f.read(8 << 20):
                    sink.write(block)
                    rows += block.count(b"\n")
        sink.close()
        if not remote:
            storage.rename(write_to, dest)
    finally:
        with contextlib.suppress(Exception):
            sink.file.close()
        if not remote:
            storage.delete([write_to])
    return {"rows": rows, **sink.entry()}


def join_dead_letters(out: Location, tmp: Location, dead_parts: dict[str, int]) -> dict:
    """The dead-letter parts (name -> records their batches reported), each checked against its
    manifest, joined into ``out``'s dead-letter file; returns that file's manifest."""
    for name, n in dead_parts.items():
        manifest = read_manifest(tmp, name)
        if manifest is None or int(manifest["rows"]) != n:
            raise RuntimeError(
                f"{storage.join(tmp, name)}: dead-letter part does not hold its {n} records"
            )
    dest = storage.join(out, shard_schema.DEAD_LETTER_FILE)
    return concat_parts(tmp, list(dead_parts), dest, sort_below=DEAD_SORT_BELOW)


def remove_tmp(tmp: Location) -> None:
    storage.rmtree(tmp)


# what an earlier run may have left in an output directory (relative names; `storage.matching`)
STALE = (
    f"*{shard_schema.SHARD_SUFFIX}",
    ".*.tmp-*",
    shard_schema.STATS_FILE,
    shard_schema.DEAD_LETTER_FILE,
    f"{TMP_PREFIX}*",
)


def prepare_out_dir(out: Location, *, overwrite: bool) -> None:
    """Refuse to write over a complete run unless `overwrite`; clear what an earlier run left.

    The COMPLETED marker is removed first, so a crash during cleanup or during the new run never
    leaves a directory that looks complete."""
    marker = storage.join(out, shard_schema.COMPLETED_MARKER)
    if storage.exists(marker) and not overwrite:
        raise FileExistsError(
            f"{out} already holds a complete run (it has {shard_schema.COMPLETED_MARKER}); "
            "pass --overwrite to replace it or choose another --out"
        )
    if not urls.is_url(out):
        out.mkdir(parents=True, exist_ok=True)
    storage.delete([marker])
    top = [n for n in storage.matching(out, list(STALE)) if "/" not in n]
    debris = [n for n in storage.matching(out, [f"{TMP_PREFIX}*/*"])]
    storage.delete([storage.join(out, n) for n in top + debris])
    if not urls.is_url(out):
        for d in out.glob(f"{TMP_PREFIX}*"):
            storage.rmtree(d)


def write_refused(out: Location, stats: dict, why: str) -> None:
    """stats.json of a run refused for its dead letters, and no COMPLETED: readers refuse the
    directory, the launcher reads why (`tagged.refuse_if_dead`), a re-run starts over."""
    _write_json(storage.join(out, shard_schema.STATS_FILE), {**stats, REFUSED: why})


def write_completed(out: Location, stats: dict, **marker) -> None:
    """stats.json, then COMPLETED (`tokenbridge.formats.shards.write_completed`'s files;
    `marker`: its keyword arguments, every file's checksum included). On an object store,
    each is one upload, and COMPLETED, the last, is the commit point."""
    if not urls.is_url(out):
        shards.write_completed(out, stats, **marker)
        return
    listed = marker.get("files") or {}
    missing = [f for f in listed if not storage.exists(storage.join(out, f))]
    if missing:
        raise FileNotFoundError(f"{out}: COMPLETED would list missing files {missing}")
    docs = shards.completed_documents(stats, **marker)
    for name in (shard_schema.STATS_FILE, shard_schema.COMPLETED_MARKER):  # the marker last
        storage.write_bytes(storage.join(out, name), docs[name])


def read_json(path: Location) -> dict:
    return json.loads(storage.read_bytes(path))
