"""Rolling part files and the finalize step: streaming writes that a crash can never half-publish.

How a writer that never groups its rows stays atomic (the align job's shards and dead letters;
the teacher cache can use the same classes):

1. Each worker writes what it gets to *part* files in the run's temporary directory
   (``<out>/.align-tmp-<run>/``), a new part when the current one reaches ``roll_bytes``.
   Every byte goes through the hash as it is written (`tokenbridge.formats.checksums.HashingSink`, the
   one place a checksum is computed), so no file is read back to checksum it.
2. Closing a part (on rolling, and at the end of the bundle) writes its footer, fsyncs it, and
   then writes its manifest ``<part>.done`` (rows, bytes, checksum). A part without a manifest
   was cut short by a crash.
3. For every batch it writes, the writer emits a small record (part name, rows, first row's
   key). Beam commits a bundle's records only if the bundle succeeds, so a part that a failed
   (and retried) bundle wrote is referenced by no record.
4. `finalize_parts`, the only grouping (over those records), checks each referenced part
   against its manifest, renames the parts into place in key order as
   ``shard-XXXXX-of-YYYYY.arrow``, and returns the index that goes into COMPLETED, which the
   caller writes last. Unreferenced parts are deleted with the temporary directory.

A reader only ever opens files that COMPLETED lists, and COMPLETED is written after every
rename, so a killed run leaves nothing that a reader takes for a shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa

from tokenbridge.formats import shard_schema as S
from tokenbridge.formats.checksums import HashingSink

TMP_PREFIX = ".align-tmp-"
REFUSED = "refused"  # stats.json key of a run its dead letters refused (no COMPLETED)
MANIFEST_SUFFIX = ".done"
DEAD_SORT_BELOW = 64 << 20  # dead-letter files smaller than this are written sorted (stable)


def run_dir(out: str | os.PathLike, run_id: str) -> Path:
    return Path(out) / f"{TMP_PREFIX}{run_id}"


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


class RollingParts:
    """Parts of one writer (one DoFn instance): ``<kind>-<writer id>-<seq><suffix>``.

    `format` "arrow": `write` takes RecordBatches (an Arrow IPC file per part, with the first
    batch's schema); "jsonl": `write` takes lists of JSON-able dicts, one line each.
    """

    def __init__(self, directory: str | os.PathLike, *, kind: str, fmt: str, roll_bytes: int):
        if fmt not in ("arrow", "jsonl"):
            raise ValueError(f"unknown part format {fmt!r}")
        self.dir, self.kind, self.fmt, self.roll_bytes = Path(directory), kind, fmt, roll_bytes
        self.writer_id = uuid.uuid4().hex[:12]
        self.seq = 0
        self.sink: HashingSink | None = None
        self.arrow: pa.ipc.RecordBatchFileWriter | None = None
        self.rows = 0

    @property
    def name(self) -> str:
        suffix = S.SHARD_SUFFIX if self.fmt == "arrow" else ".jsonl"
        return f"{self.kind}-{self.writer_id}-{self.seq:05d}{suffix}"

    def write(self, data) -> str:
        """Append a batch to the current part (opening one if needed); returns its name."""
        if self.sink is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.sink = HashingSink(self.dir / self.name)
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
        _write_json(self.dir / (name + MANIFEST_SUFFIX), manifest)
        self.sink = None
        self.seq += 1

    def abort(self) -> None:
        """Drop the current part (best effort: an unreferenced part is removed anyway)."""
        if self.sink is not None:
            with contextlib.suppress(Exception):
                if self.arrow is not None:
                    self.arrow.close()
                self.sink.file.close()
            with contextlib.suppress(OSError):
                (self.dir / self.name).unlink()
            self.sink, self.arrow = None, None


def read_manifest(directory: Path, name: str) -> dict | None:
    try:
        return json.loads((directory / (name + MANIFEST_SUFFIX)).read_text())
    except (OSError, ValueError):
        return None


def finalize_parts(out: Path, tmp: Path, parts: dict[str, dict], *, name_for) -> dict[str, dict]:
    """Move the referenced parts into place; returns {final name: manifest + first key}.

    parts: part name -> {"rows": rows its records reported, "key": the smallest row key}.
    name_for(i, n): the final name of the i-th of n parts (in key order). Idempotent: a part
    already moved by an earlier attempt of this step is found at its final name.
    """
    order = sorted(parts, key=lambda p: (parts[p]["key"], p))
    index = {}
    for i, part in enumerate(order):
        final = name_for(i, len(order))
        manifest = read_manifest(tmp, part)
        if manifest is None:
            raise RuntimeError(f"{tmp / part}: no manifest; the part was not closed")
        if int(manifest["rows"]) != int(parts[part]["rows"]):
            raise RuntimeError(
                f"{tmp / part}: {manifest['rows']} rows on disk, its batches reported "
                f"{parts[part]['rows']}"
            )
        if (tmp / part).exists():
            os.replace(tmp / part, out / final)
        elif not (out / final).exists():
            raise RuntimeError(f"{tmp / part}: referenced part is missing")
        index[final] = {**manifest, "key": parts[part]["key"]}
    return index


def concat_parts(tmp: Path, names: list[str], dest: Path, *, sort_below: int) -> dict:
    """Concatenate jsonl parts into `dest` (atomically); sorted lines when the total is below
    `sort_below` bytes (a stable file), in part order above. Returns its manifest."""
    parts = [tmp / n for n in sorted(names)]
    total = sum(p.stat().st_size for p in parts)
    tmp_dest = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    sink = HashingSink(tmp_dest)
    rows = 0
    try:
        if total < sort_below:
            lines = sorted(line for p in parts for line in p.read_bytes().splitlines(True))
            sink.write(b"".join(lines))
            rows = len(lines)
        else:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(8 << 20):
                        sink.write(block)
                        rows += block.count(b"\n")
        sink.close()
        os.replace(tmp_dest, dest)
    finally:
        sink.close()
        tmp_dest.unlink(missing_ok=True)
    return {"rows": rows, **sink.entry()}


def join_dead_letters(out: Path, tmp: Path, dead_parts: dict[str, int]) -> dict:
    """The dead-letter parts (name -> records their batches reported), each checked against its
    manifest, joined into ``out``'s dead-letter file; returns that file's manifest."""
    for name, n in dead_parts.items():
        manifest = read_manifest(tmp, name)
        if manifest is None or int(manifest["rows"]) != n:
            raise RuntimeError(f"{tmp / name}: dead-letter part does not hold its {n} records")
    return concat_parts(tmp, list(dead_parts), out / S.DEAD_LETTER_FILE, sort_below=DEAD_SORT_BELOW)


def remove_tmp(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def prepare_out_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse to write over a complete run unless `overwrite`; clear what an earlier run left.

    The COMPLETED marker is removed first, so a crash during cleanup or during the new run never
    leaves a directory that looks complete."""
    marker = out / S.COMPLETED_MARKER
    if marker.exists() and not overwrite:
        raise FileExistsError(
            f"{out} already holds a complete run (it has {S.COMPLETED_MARKER}); "
            "pass --overwrite to replace it or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    stale = [*out.glob(f"*{S.SHARD_SUFFIX}"), *out.glob(".*.tmp-*")]
    stale += [out / S.STATS_FILE, out / S.DEAD_LETTER_FILE]
    for p in stale:
        if p.is_file():
            p.unlink()
    for d in out.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(d, ignore_errors=True)


def write_refused(out: Path, stats: dict, why: str) -> None:
    """stats.json of a run refused for its dead letters, and no COMPLETED: readers refuse the
    directory, the launcher reads why (`tagged.refuse_if_dead`), a re-run starts over."""
    _write_json(out / S.STATS_FILE, {**stats, REFUSED: why})
