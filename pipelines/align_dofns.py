"""The DoFns of the align job (`pipelines.align_job` assembles them into the pipeline).

They live in the package, not next to the pipeline or in tests, because Beam's multi-process
workers and Dask workers unpickle them by module path. Each one is a thin shell around pure
functions (`readers`, `tokenizer`, `alignment`, `windows`, `shards`): tokenizers are loaded once
per worker process in `setup()` (shared between DoFns through a per-process cache), every drop
and fallback bumps a `Metrics` counter and sends a dead letter to the ``DEAD`` stream,
and the time spent per stage goes into `Metrics` distributions (microseconds) for the benchmark.

Two limits of Beam 2.77's DaskRunner shape the code, so one pipeline runs on every runner:
it drops what a DoFn emits from ``finish_bundle`` (so batching is a keyed GroupByKey, not
``BatchElements``), and it mixes the tagged outputs of a multi-output ParDo into one stream (so
DoFns with several outputs emit ``(tag, value)`` pairs that the job splits with `select`).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.metrics import Metrics

from pipelines import readers, shards
from pipelines.align import (
    Alignment,
    AlignmentError,
    WindowConfig,
    WindowError,
    align_batch_flat,
    cut_windows,
    vocab_bytes,
)
from pipelines.tokenizers import Encoding, Tokenizer, load_tokenizer

NAMESPACE = "tokenbridge"
MAIN = "main"  # tag of a DoFn's main output
DEAD = "dead_letter"  # tag of the dead-letter outputs
STATS = "stats"  # tag of the per-batch statistics outputs

# dead-letter reasons added by the job (the readers define theirs)
UNCUTTABLE = "uncuttable_document"
TOKENIZER_ERROR = "tokenizer_error"
ALIGN_ERROR = "align_error"
NO_TOKENS = "no_tokens"

_WARMUP = "Warm-up: naïve café, 12 tokens\n\tand 日本語."
_TOKENIZERS: dict[str, Tokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def cached_tokenizer(path: str) -> Tokenizer:
    """One tokenizer object per worker process and path (DoFn.setup calls this)."""
    with _TOKENIZERS_LOCK:
        if path not in _TOKENIZERS:
            _TOKENIZERS[path] = load_tokenizer(path)
        return _TOKENIZERS[path]


def count(name: str, n: int = 1) -> None:
    Metrics.counter(NAMESPACE, name).inc(n)


class _Timer:
    """``with _Timer("tokenize"):`` adds the elapsed microseconds to ``stage_us.<name>``."""

    def __init__(self, name: str):
        self.dist = Metrics.distribution(NAMESPACE, f"stage_us.{name}")

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.dist.update(int((time.perf_counter() - self.t0) * 1e6))


def dead(record: dict) -> tuple[str, dict]:
    count(f"dead_letter.{record['reason']}")
    return DEAD, record


def select(item: tuple[str, object], tag: str) -> list:
    """FlatMap body: the value of a ``(tag, value)`` pair if it carries `tag`."""
    return [item[1]] if item[0] == tag else []


def shard_of(doc_id: str, num_shards: int) -> int:
    """Stable across processes and runs (unlike hash()): all windows of a doc in one shard."""
    return zlib.crc32(doc_id.encode("utf-8")) % num_shards


def merge_stats(a, b):
    """Sum two statistics values: numbers add, dicts merge by key, lists add elementwise
    (recursively, so per-teacher lists of histograms add up)."""
    if isinstance(a, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = merge_stats(out[k], v) if k in out else v
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            raise ValueError(f"cannot add statistics lists of lengths {len(a)} and {len(b)}")
        return [merge_stats(x, y) for x, y in zip(a, b)]
    return a + b


@dataclass(frozen=True)
class AlignedDoc:
    doc_id: str
    file: str
    text: str
    student: Encoding
    teachers: list[tuple[Encoding, Alignment]]  # per teacher: its encoding, alignment to student


BATCH_CHARS = 1 << 20  # text per tokenization batch (a longer document is a batch alone)
BATCH_DOCS = 1024  # documents per tokenization batch


def _full(batch: list, chars: int, doc: readers.Doc) -> bool:
    return bool(batch) and (chars + len(doc.text) > BATCH_CHARS or len(batch) >= BATCH_DOCS)


def chunk_docs(docs):
    """Lists of consecutive docs of at most BATCH_CHARS characters and BATCH_DOCS docs."""
    batch, chars = [], 0
    for d in docs:
        if _full(batch, chars, d):
            yield batch
            batch, chars = [], 0
        batch.append(d)
        chars += len(d.text)
    if batch:
        yield batch


class ReadFileDoFn(beam.DoFn):
    """(path, doc id prefix) -> (MAIN, list of `readers.Doc`) per chunk of a file's documents
    (few large elements to shuffle, not one per verse-sized document), streamed as the file is
    read; (DEAD, record) per bad record."""

    def __init__(self, config: readers.ReaderConfig):
        self.config = config

    def process(self, item):
        path, doc_id = item
        count("files_read")
        batch, chars, n = [], 0, 0
        for x in readers.read_file(path, doc_id, self.config):
            if not isinstance(x, readers.Doc):
                yield dead(x)
                continue
            if _full(batch, chars, x):
                yield MAIN, batch
                batch, chars = [], 0
            batch.append(x)
            chars += len(x.text)
            n += 1
        if batch:
            yield MAIN, batch
        count("documents_read", n)


class SplitBatchesDoFn(beam.DoFn):
    """(group key, chunks of docs) -> tokenization batches (`chunk_docs`), in doc id order so
    a rerun cuts the same batches whatever order the shuffle delivered them in."""

    def process(self, item):
        _, chunks = item
        docs = sorted((d for c in chunks for d in c), key=lambda d: d.doc_id)
        yield from chunk_docs(docs)


class TokenizeAlignDoFn(beam.DoFn):
    """A batch of docs -> a list of `AlignedDoc`: one ``encode_batch`` per tokenizer for the whole
    batch, then one ``align_batch`` per teacher. A doc the tokenizer or aligner fails on goes to
    the dead letters (the batch is redone one doc at a time to find it)."""

    def __init__(self, student_path: str, teacher_paths: list[str]):
        self.student_path, self.teacher_paths = student_path, list(teacher_paths)

    def setup(self):
        self.student = cached_tokenizer(self.student_path)
        self.teachers = [cached_tokenizer(p) for p in self.teacher_paths]
        self.student_bytes = vocab_bytes(self.student)  # byte tables for the DP fallback
        self.teacher_bytes = [vocab_bytes(t) for t in self.teachers]
        # the first kernel call loads (or compiles) the Numba code: do it once here, not in the
        # first batch, so the stage times measure the work
        s = self.student.encode_batch([_WARMUP])
        for t, tb in zip(self.teachers, self.teacher_bytes):
            t_enc = t.encode_batch([_WARMUP])
            align_batch_flat(s, t_enc, student_bytes=self.student_bytes, teacher_bytes=tb)

    def _encode(self, docs: list[readers.Doc]):
        texts = [d.text for d in docs]
        try:
            with _Timer("tokenize"):
                s = self.student.encode_batch(texts)
                ts = [t.encode_batch(texts) for t in self.teachers]
        except Exception as e:
            raise _StageError(TOKENIZER_ERROR, e) from e
        return s, ts

    def process(self, docs: list[readers.Doc]):
        try:
            encoded = [(docs, self._encode(docs))]
        except _StageError:
            # redo one document at a time so only the culprit is dropped
            count("batches_redone_per_document")
            encoded = []
            for d in docs:
                try:
                    encoded.append(([d], self._encode([d])))
                except _StageError as e:
                    yield dead(readers.dead_letter(d.file, e.reason, e.detail, doc_id=d.doc_id))
        aligned, failed = [], []
        for part, (s, ts) in encoded:
            with _Timer("align"):  # the kernel and the per-document Alignment views
                flat = [
                    align_batch_flat(s, t, student_bytes=self.student_bytes, teacher_bytes=tb)
                    for t, tb in zip(ts, self.teacher_bytes)
                ]
                per_doc = []
                for b, d in enumerate(part):
                    try:
                        per_doc.append((b, d, [f.row(b) for f in flat]))
                    except AlignmentError as e:
                        failed.append((d, e))
            for b, d, als in per_doc:
                for i, al in enumerate(als):
                    if al.used_fallback:
                        count(f"align_fallback_documents.teacher{i}")
                teachers = [(t.row(b), al) for t, al in zip(ts, als)]
                aligned.append(AlignedDoc(d.doc_id, d.file, d.text, s.row(b), teachers))
        for d, e in failed:
            yield dead(readers.dead_letter(d.file, ALIGN_ERROR, str(e), doc_id=d.doc_id))
        count("documents_aligned", len(aligned))
        if aligned:
            yield MAIN, aligned


class _StageError(Exception):
    def __init__(self, reason: str, cause: Exception):
        super().__init__(reason)
        self.reason, self.detail = reason, f"{type(cause).__name__}: {cause}"


def doc_stats(a: AlignedDoc, windows) -> dict:
    """What one document adds to stats.json."""
    return {
        "documents": 1,
        "windows": len(windows),
        "student_tokens": int(sum(len(w.student_ids) for w in windows)),
        "teacher_tokens": [
            int(sum(len(w.teacher_ids[i]) for w in windows)) for i in range(len(a.teachers))
        ],
        "chunk_kinds": [
            np.bincount(al.chunk_kind.astype(np.int64), minlength=4)[:4].tolist()
            for _, al in a.teachers
        ],
        "exact_chunks": [int(np.count_nonzero(al.chunk_exact)) for _, al in a.teachers],
        "fallback_documents": [int(al.used_fallback) for _, al in a.teachers],
        # tokens one side has and the other cannot pair (e.g. a byte the student cannot spell)
        "dropped_tokens": [int(getattr(al, "dropped_tokens", 0)) for _, al in a.teachers],
    }


class CutWindowsDoFn(beam.DoFn):
    """A list of `AlignedDoc` -> (shard index, Arrow IPC bytes of that shard's window rows);
    per-batch statistics on ``STATS``; uncuttable documents on ``DEAD`` (all as tag pairs)."""

    def __init__(
        self,
        student_path: str,
        teacher_paths: list[str],
        *,
        config: WindowConfig,
        schema: pa.Schema,
        num_shards: int,
    ):
        self.student_path, self.teacher_paths = student_path, list(teacher_paths)
        self.config, self.schema, self.num_shards = config, schema, num_shards

    def setup(self):
        self.student = cached_tokenizer(self.student_path)
        self.teachers = [cached_tokenizer(p) for p in self.teacher_paths]

    def process(self, batch: list[AlignedDoc]):
        rows: dict[int, list[tuple[str, object]]] = defaultdict(list)
        stats: dict = {}
        with _Timer("windows"):
            for a in batch:
                try:
                    windows = cut_windows(
                        a.text,
                        student=(self.student, a.student),
                        teachers=[(t, enc, al) for t, (enc, al) in zip(self.teachers, a.teachers)],
                        config=self.config,
                    )
                except WindowError as e:
                    yield dead(readers.dead_letter(a.file, UNCUTTABLE, str(e), doc_id=a.doc_id))
                    continue
                if not windows:
                    yield dead(
                        readers.dead_letter(
                            a.file, NO_TOKENS, "no tokens on any side", doc_id=a.doc_id
                        )
                    )
                    continue
                count("windows", len(windows))
                stats = merge_stats(stats, doc_stats(a, windows))
                shard = shard_of(a.doc_id, self.num_shards)
                rows[shard] += [(a.doc_id, w) for w in windows]
        with _Timer("to_arrow"):
            for shard, shard_rows in sorted(rows.items()):
                blob = shards.batch_to_bytes(shards.windows_to_batch(shard_rows, self.schema))
                yield MAIN, (shard, blob)
        if stats:
            yield STATS, ("stats", stats)


class WriteShardDoFn(beam.DoFn):
    """(shard index, Arrow IPC blobs) -> one shard file, rows sorted by (doc_id, window) so the
    file does not depend on how the runner split the work; -> ("file", name, rows)."""

    def __init__(self, out_dir: str, *, schema: pa.Schema, num_shards: int):
        self.out_dir, self.schema, self.num_shards = out_dir, schema, num_shards

    def process(self, item):
        shard, blobs = item
        with _Timer("write"):
            tables = [shards.batch_from_bytes(b) for b in blobs]
            table = pa.concat_tables(tables).sort_by(
                [("doc_id", "ascending"), ("window", "ascending")]
            )
            name = shards.shard_name(shard, self.num_shards)
            with shards.ShardWriter(Path(self.out_dir) / name, self.schema) as w:
                w.write_table(table)
        count("rows_written", table.num_rows)
        count("shards_written")
        yield ("file", name, table.num_rows)


class WriteDeadLettersDoFn(beam.DoFn):
    """(None, all dead letters) -> dead_letter.jsonl; -> ("dead", {reason: count})."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def process(self, item):
        _, records = item
        records = list(records)
        shards.write_dead_letters(self.out_dir, records)
        yield ("dead", dict(Counter(r["reason"] for r in records)))


class SummaryCombineFn(beam.CombineFn):
    """Everything the final step needs, in one element: written files, stats, drops by reason."""

    def create_accumulator(self):
        return {"files": {}, "stats": {}, "dead": {}}

    def add_input(self, acc, item):
        if item[0] == "file":
            acc["files"][item[1]] = item[2]
        elif item[0] == "stats":
            acc["stats"] = merge_stats(acc["stats"], item[1])
        else:
            acc["dead"] = merge_stats(acc["dead"], item[1])
        return acc

    def merge_accumulators(self, accs):
        out = self.create_accumulator()
        for a in accs:
            out["files"].update(a["files"])
            out["stats"] = merge_stats(out["stats"], a["stats"])
            out["dead"] = merge_stats(out["dead"], a["dead"])
        return out

    def extract_output(self, acc):
        return acc


class FinalizeDoFn(beam.DoFn):
    """The single last step: empty files for shard indices that got no rows, an empty dead-letter
    file if nothing was dropped, then stats.json and COMPLETED. It runs only once every shard
    and the dead-letter file are written, because its input is a global combine over them."""

    def __init__(self, out_dir: str, *, schema: pa.Schema, num_shards: int, header: dict):
        self.out_dir, self.schema, self.num_shards = out_dir, schema, num_shards
        self.header = header

    def process(self, summary):
        out = Path(self.out_dir)
        files = dict(summary["files"])
        for i in range(self.num_shards):
            name = shards.shard_name(i, self.num_shards)
            if name not in files:
                with shards.ShardWriter(out / name, self.schema):
                    pass
                files[name] = 0
        if not summary["dead"]:
            shards.write_dead_letters(out, [])
        stats = final_stats(self.header, summary["stats"], summary["dead"], files)
        shards.write_completed(out, stats, files=files)
        yield stats


CHUNK_KIND_NAMES = ("1:1", "1:N", "N:1", "N:M")  # student:teacher tokens, CHUNK_* order


def final_stats(header: dict, stats: dict, dropped: dict, files: dict[str, int]) -> dict:
    """stats.json: the run's header (tokenizers, config) plus totals over all documents."""
    n_t = len(header["teachers"])
    docs = int(stats.get("documents", 0))
    kinds = stats.get("chunk_kinds", [[0] * 4 for _ in range(n_t)])
    chunks = [int(sum(k)) for k in kinds]
    exact = stats.get("exact_chunks", [0] * n_t)
    fallback = stats.get("fallback_documents", [0] * n_t)
    return {
        **header,
        "documents": docs,
        "windows": int(stats.get("windows", 0)),
        "rows": int(sum(files.values())),
        "shards": len(files),
        "tokens": {
            "student": int(stats.get("student_tokens", 0)),
            "teachers": [int(x) for x in stats.get("teacher_tokens", [0] * n_t)],
        },
        "chunks": chunks,
        "chunk_kinds": [dict(zip(CHUNK_KIND_NAMES, map(int, k))) for k in kinds],
        "exact_chunk_fraction": [e / c if c else 0.0 for e, c in zip(exact, chunks)],
        "fallback_documents": [int(f) for f in fallback],
        "fallback_rate": [f / docs if docs else 0.0 for f in fallback],
        "dropped_tokens": [int(x) for x in stats.get("dropped_tokens", [0] * n_t)],
        "dead_letters": int(sum(dropped.values())),
        "drops_by_reason": dict(sorted((k, int(v)) for k, v in dropped.items())),
    }
