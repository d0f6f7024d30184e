"""The teacher-cache job's DoFns around the teacher: read shard rows in token-bounded batches,
write cache parts, finalize (the teacher itself runs in RunInference: `handler`).

Rows are sorted by length within a task before batching, so batches pad little; rows with ids
outside the teacher's vocabulary are dead letters (the model would index past its embedding).
As in the align job, everything leaves from ``process``, several outputs as ``(tag, value)``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa

from pipelines.plumbing import progress, rolling, storage
from pipelines.plumbing.tagged import MAIN, MAX_DEAD_FRACTION, StageTimer, count, dead, dead_verdict
from pipelines.plumbing.writers import RollingPartsDoFn
from pipelines.teacher_cache.handler import RowBatch, ScoredBatch
from tokenbridge import urls
from tokenbridge.formats import checksums, shard_schema, teacher_cache

# the statistics vector of one written batch, summed by `SummaryCombineFn`
STATS = ("rows", "positions", "padded_positions", "batches", "inference_us")
ID_OUT_OF_RANGE = "id_out_of_range"
INFERENCE_ERROR = "inference_error"


@dataclass(frozen=True)
class RowTask:
    path: str  # the shard file: a local path, or an object-store URL
    start: int
    end: int
    expected: dict | None = None  # the marker's checksum entry of a URL's object


def cut_batches(lengths: np.ndarray, *, budget: int, max_rows: int) -> list[np.ndarray]:
    """Indices into `lengths`, longest first, grouped so that rows x longest <= budget (a row
    longer than the budget goes alone) and at most `max_rows` rows per group."""
    order = np.argsort(-lengths, kind="stable")
    out, cur, longest = [], [], 0
    for i in order:
        n = int(lengths[i])
        top = max(longest, n)
        if cur and ((len(cur) + 1) * top > budget or len(cur) == max_rows):
            out.append(np.asarray(cur))
            cur, top = [], n
        cur.append(int(i))
        longest = top
    if cur:
        out.append(np.asarray(cur))
    return out


class ReadRowBatchesDoFn(beam.DoFn):
    """`RowTask` -> (MAIN, `RowBatch`) per token-bounded batch, (DEAD, record) per bad row."""

    def __init__(self, *, teacher_index: int, vocab_size: int, budget: int, max_rows: int):
        self.column = shard_schema.teacher_ids_column(teacher_index)
        self.vocab_size, self.budget, self.max_rows = vocab_size, budget, max_rows

    def setup(self):
        self._object: tuple[str, pa.Table] | None = None  # the last object read: its table

    def _table(self, task: RowTask) -> pa.Table:
        """A URL's object read whole once per run of tasks on it (a file's tasks are planned in
        a row), its bytes checked against the marker's entry."""
        if self._object is None or self._object[0] != task.path:
            data = storage.read_bytes(task.path)
            if task.expected is not None:
                checksums.check_bytes(data, task.expected, where=task.path)
            self._object = (task.path, pa.ipc.open_file(pa.py_buffer(data)).read_all())
        return self._object[1]

    def process(self, task: RowTask):
        name = Path(task.path).name
        with contextlib.ExitStack() as stack:
            if urls.is_url(task.path):
                table = self._table(task)
            else:
                src = stack.enter_context(pa.memory_map(task.path, "r"))
                table = pa.ipc.open_file(src).read_all()
            table = table.slice(task.start, task.end - task.start)
            col = table.column(self.column).combine_chunks()
            # copied out while the file is mapped: the arrays may be views of the map
            offsets = col.offsets.to_numpy().copy()
            flat = col.values.to_numpy().copy()
        rows, ids = [], []
        for j in range(len(offsets) - 1):
            x = flat[offsets[j] : offsets[j + 1]].astype(np.int64)
            row = task.start + j
            if x.size and (x.min() < 0 or x.max() >= self.vocab_size):
                yield dead({"reason": ID_OUT_OF_RANGE, "shard_file": name, "row": row,
                            "detail": f"{self.column} ids {x.min()}..{x.max()}, vocabulary "
                                      f"{self.vocab_size}"})  # fmt: skip
                continue
            rows.append(row)
            ids.append(x)
        lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
        for group in cut_batches(lengths, budget=self.budget, max_rows=self.max_rows):
            rb = RowBatch(
                name, np.asarray([rows[i] for i in group], np.int32), [ids[i] for i in group]
            )
            yield MAIN, rb


def split_scored(scored: ScoredBatch) -> list[tuple[str, object]]:
    """Rows the teacher failed on -> (DEAD, record); the batch without them -> (MAIN, ...)."""
    if not scored.errors:
        return [(MAIN, scored)]
    b = scored.batch
    out: list[tuple[str, object]] = []
    for i, err in sorted(scored.errors.items()):
        rec = {"reason": INFERENCE_ERROR, "shard_file": b.shard_file, "row": int(b.rows[i])}
        out.append(dead({**rec, "detail": err}))
    keep = [i for i in range(len(b)) if i not in scored.errors]
    if keep:
        sub = RowBatch(b.shard_file, b.rows[keep], [b.ids[i] for i in keep])
        outs = {k: v[keep] for k, v in scored.outputs.items()}
        out.append((MAIN, ScoredBatch(sub, outs, scored.seconds)))
    return out


def _lists(values: list[np.ndarray], arrow_type: pa.DataType) -> pa.Array:
    lengths = np.fromiter((v.size for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([v.ravel() for v in values]) if values else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=arrow_type))


def to_record_batch(
    scored: ScoredBatch, meta: teacher_cache.CacheMeta, schema: pa.Schema
) -> pa.RecordBatch:
    """The cache rows of one scored batch (see `tokenbridge.formats.teacher_cache`)."""
    b, lens, o = scored.batch, scored.batch.lengths, scored.outputs
    n = len(b)
    lp_type = teacher_cache.LOGPROB_DTYPES[meta.logprob_dtype][0]
    cols: dict[str, pa.Array] = {
        "shard_file": pa.array([b.shard_file] * n, pa.string()),
        "row": pa.array(b.rows.astype(np.int32)),
    }
    ids, lps, tails, targets, s_n, s_ids, s_counts = [], [], [], [], [], [], []
    for i, u in enumerate(lens):
        u = int(u)
        lp = o["topk_logprobs"][i, :u] if u else np.zeros((0, meta.k), np.float32)
        raw = o["topk_ids"][i, :u] if u else np.zeros((0, meta.k), np.int64)
        ids.append(teacher_cache.pack_ids(np.where(raw >= 0, raw, 0), meta.id_bits))
        lps.append(teacher_cache.encode_logprobs(lp, meta.logprob_dtype))
        tails.append(o["tail_logprob"][i, :u].astype(np.float32) if u else np.zeros(0, np.float32))
        if meta.target:
            t = o["target_logprob"][i, :u] if u else np.zeros(0)
            targets.append(t.astype(np.float32))
        if meta.samples:
            drawn = o["sample_ids"][i, :u] if u else np.zeros((0, meta.samples), np.int64)
            first = np.ones(drawn.shape, bool)
            first[:, 1:] = drawn[:, 1:] != drawn[:, :-1]  # sorted: a new id starts a run
            starts = np.flatnonzero(first.ravel())
            ends = np.append(starts[1:], drawn.size)
            s_n.append(first.sum(1).astype(np.uint8))
            s_ids.append(teacher_cache.pack_ids(drawn.ravel()[starts], meta.id_bits))
            s_counts.append((ends - starts).astype(np.uint8))
    cols["topk_ids"] = pa.array(ids, pa.binary())
    cols["topk_logprobs"] = _lists(lps, lp_type)
    cols["tail_logprob"] = _lists(tails, pa.float32())
    if meta.target:
        cols["target_logprob"] = _lists(targets, pa.float32())
    if meta.samples:
        cols["sample_n"] = _lists(s_n, pa.uint8())
        cols["sample_ids"] = pa.array(s_ids, pa.binary())
        cols["sample_counts"] = _lists(s_counts, pa.uint8())
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


class WriteCacheDoFn(RollingPartsDoFn):
    """`ScoredBatch` -> rows appended to this bundle's rolling cache part -> one record."""

    KIND, FMT = "cache", "arrow"

    def __init__(
        self, tmp_dir: str, *, meta: teacher_cache.CacheMeta, roll_bytes: int, progress_dir=None
    ):
        super().__init__(tmp_dir, roll_bytes=roll_bytes)
        self.meta, self.progress_dir = meta, progress_dir

    def setup(self):
        self.schema = self.meta.schema()
        self.progress = progress.sink_for(self.progress_dir)

    def process(self, scored: ScoredBatch):
        b, lens = scored.batch, scored.batch.lengths
        with StageTimer("write"):
            name = self.parts.write(to_record_batch(scored, self.meta, self.schema))
        count("rows_written", len(b))
        vec = np.array(
            [len(b), lens.sum(), len(b) * lens.max(initial=0), 1, int(scored.seconds * 1e6)],
            np.int64,
        )
        if self.progress is not None:
            self.progress.add(bytes=int(lens.sum()), documents=len(b), tokens=int(lens.sum()))
        yield ("part", name, len(b), (b.shard_file, int(b.rows.min())), vec)


class FinalizeCacheDoFn(beam.DoFn):
    """The last step: parts into place, dead letters joined, stats.json, then COMPLETED (not
    when the dead letters exceed ``max_dead_fraction``: stats.json then says why)."""

    def __init__(
        self,
        out_dir: str,
        tmp_dir: str,
        *,
        meta: teacher_cache.CacheMeta,
        header: dict,
        max_dead_fraction: float = MAX_DEAD_FRACTION,
    ):
        self.out_dir, self.tmp_dir, self.meta, self.header = out_dir, tmp_dir, meta, header
        self.max_dead_fraction = max_dead_fraction

    def process(self, summary):
        out, tmp = storage.location(self.out_dir), storage.location(self.tmp_dir)
        index = rolling.finalize_parts(
            out, tmp, summary["parts"], name_for=teacher_cache.cache_name
        )
        dead_info = rolling.join_dead_letters(out, tmp, dict(summary["dead_parts"]))
        files = {name: int(info["rows"]) for name, info in index.items()}
        stats = cache_stats(self.header, self.meta, summary["stats"], index, dict(summary["dead"]))
        # every dead letter here is a row without outputs (none is partial)
        why = dead_verdict(
            stats["rows"], dict(summary["lost"]), max_fraction=self.max_dead_fraction, unit="rows"
        )
        if why is not None:
            rolling.write_refused(out, stats, why)
        else:
            file_sums = {name: checksums.manifest_entry(info) for name, info in index.items()}
            file_sums[shard_schema.DEAD_LETTER_FILE] = checksums.manifest_entry(dead_info)
            rolling.write_completed(
                out,
                stats,
                files=files,
                checksums=file_sums,
                kind=teacher_cache.KIND,
                schema_version=teacher_cache.CACHE_SCHEMA_VERSION,
            )
        rolling.remove_tmp(tmp)
        yield stats


def cache_stats(
    header: dict, meta: teacher_cache.CacheMeta, vec, index: dict, dropped: dict
) -> dict:
    """stats.json: what the cache promises (``cache``: `CacheMeta`), sizes and throughput."""
    v = dict(zip(STATS, map(int, vec if vec is not None else np.zeros(len(STATS), np.int64))))
    size = sum(int(info["bytes"]) for info in index.values())
    wall = time.time() - header["started"]
    infer_s = v["inference_us"] / 1e6
    return {
        **header,
        "kind": teacher_cache.KIND,
        "cache": meta.to_json(),
        "rows": v["rows"],
        "teacher_tokens": v["positions"],
        "batches": v["batches"],
        "padding_fraction": 1 - v["positions"] / v["padded_positions"] if v["positions"] else 0.0,
        "files": len(index),
        "bytes": size,
        "bytes_per_token": size / v["positions"] if v["positions"] else 0.0,
        "inference_s": round(infer_s, 3),
        "teacher_tokens_per_s": v["positions"] / infer_s if infer_s else 0.0,
        "wall_s": round(wall, 3),
        "wall_tokens_per_s": v["positions"] / wall if wall > 0 else 0.0,
        "dead_letters": int(sum(dropped.values())),
        "drops_by_reason": dict(sorted((k, int(n)) for k, n in dropped.items())),
    }
