"""The align job's text path: DoFns that read documents in batches, tokenize, align, cut windows.

Each is a thin shell over pure functions (`readers`, `tokenbridge.alignment`): tokenizers are
loaded once per worker process (`cached_tokenizer`), elements are columnar batches (`DocBatch`,
`Windows`), every drop is a counted dead letter, and stage times go to `Metrics` distributions.
Records leave from ``process`` as ``(tag, value)`` pairs, for the DaskRunner (docs/pipelines.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from concurrent.futures import wait
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
import pyarrow as pa

from pipelines.align import job_stats, readers, worker_state
from pipelines.plumbing import progress
from pipelines.plumbing.tagged import MAIN, StageTimer, count, dead
from tokenbridge import remote_models
from tokenbridge.alignment import WindowConfig, window_batch, window_kernel
from tokenbridge.alignment.chunks import AlignmentError, align_batch_flat, vocab_bytes
from tokenbridge.alignment.long_documents import PieceConfig, PieceWalk
from tokenbridge.formats import shard_schema
from tokenbridge.tokenizers import Tokenizer, load_tokenizer

# dead-letter reasons added by the job (the readers define theirs)
UNCUTTABLE = "uncuttable_document"
TOKENIZER_ERROR = "tokenizer_error"
ALIGN_ERROR = "align_error"
NO_TOKENS = "no_tokens"

BATCH_CHARS = 1 << 20  # text per tokenization batch (a longer document is a batch alone)
BATCH_DOCS = 1024  # documents per tokenization batch

_WARMUP = "Warm-up: naïve café, 12 tokens\n\tand 日本語."
_TOKENIZERS: dict[str, Tokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def cached_tokenizer(path: str) -> Tokenizer:
    """One tokenizer object per worker process and path (DoFn.setup calls this); a URL is read
    from this machine's verified copy (`tokenbridge.remote_models`, fetched once per machine)."""
    with _TOKENIZERS_LOCK:
        if path not in _TOKENIZERS:
            _TOKENIZERS[path] = load_tokenizer(remote_models.local_copy(path))
            release_free_memory()
        return _TOKENIZERS[path]


def release_free_memory() -> None:
    """Hand freed heap back to the OS (glibc only; elsewhere a no-op). Parsing Gemma's 33 MB
    tokenizer.json leaves ~185 MB of freed temporaries that glibc keeps: in every worker."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass(frozen=True)
class InputSplit:
    """What one read task reads: a file, or a byte range of a large jsonl file."""

    path: str
    doc_id: str  # prefix of its documents' ids (the file's name relative to its glob)
    split: readers.Split
    size: int  # input bytes it stands for (progress)


@dataclass(frozen=True)
class DocBatch:
    """Consecutive documents of one file, for one `encode_batch` per tokenizer."""

    file: str
    doc_ids: list[str]
    texts: list[str]
    source_bytes: int  # input bytes they were read from (progress)


@dataclass(frozen=True)
class Windows:
    """Shard rows of some documents (maybe none) and the statistics they add."""

    batch: pa.RecordBatch
    stats: np.ndarray  # int64, `job_stats.StatsLayout`


class ReadSplitDoFn(beam.DoFn):
    """`InputSplit` -> (MAIN, `DocBatch`) per up to BATCH_CHARS / BATCH_DOCS documents, streamed
    as the file is read; (DEAD, record) per bad record."""

    def __init__(self, config: readers.ReaderConfig, *, progress_dir: str | None = None):
        self.config, self.progress_dir = config, progress_dir

    def process(self, item: InputSplit):
        if item.split.start == 0:
            count("files_read")
        pos = readers.Position()
        ids, texts, chars, n, reported = [], [], 0, 0, 0
        for x in readers.read_file(item.path, item.doc_id, self.config, split=item.split, pos=pos):
            if not isinstance(x, readers.Doc):
                yield dead(x)
                continue
            if ids and (chars + len(x.text) > BATCH_CHARS or len(ids) >= BATCH_DOCS):
                yield MAIN, DocBatch(item.path, ids, texts, pos.bytes - reported)
                reported = pos.bytes
                ids, texts, chars = [], [], 0
            ids.append(x.doc_id)
            texts.append(x.text)
            chars += len(x.text)
            n += 1
        rest = max(item.size - reported, 0)  # txt / parquet count their bytes at the end
        if ids:
            yield MAIN, DocBatch(item.path, ids, texts, rest)
        else:
            sink = progress.sink_for(self.progress_dir)
            if sink is not None:
                sink.add(bytes=rest)
        count("documents_read", n)


class _StageError(Exception):
    def __init__(self, reason: str, cause: Exception):
        super().__init__(reason)
        self.reason, self.detail = reason, f"{type(cause).__name__}: {cause}"


class AlignWindowsDoFn(beam.DoFn):
    """`DocBatch` -> (MAIN, `Windows`): tokenize every document with every tokenizer (one
    ``encode_batch`` per tokenizer), align each teacher to the student (one kernel call per
    teacher), cut the windows of the whole batch and build its Arrow rows. Long documents go
    piece by piece (one `Windows` per piece). Failures per document -> (DEAD, record)."""

    def __init__(
        self,
        student: str,
        teachers: list[str],
        *,
        window: WindowConfig,
        pieces: PieceConfig,
        progress_dir: str | None = None,
    ):
        self.student_path, self.teacher_paths = student, list(teachers)
        self.window, self.pieces, self.progress_dir = window, pieces, progress_dir

    def setup(self):
        self.student = cached_tokenizer(self.student_path)
        self.teachers = [cached_tokenizer(p) for p in self.teacher_paths]
        self.student_bytes = vocab_bytes(self.student)  # byte tables for the DP fallback
        self.teacher_bytes = [vocab_bytes(t) for t in self.teachers]
        self.schema = shard_schema.shard_schema(
            self.student.info(), [t.info() for t in self.teachers]
        )
        self.layout = job_stats.StatsLayout(len(self.teachers))
        w = self.window
        self.specials = [
            (tok.bos_id if w.add_bos else None, tok.eos_id if w.add_eos else None)
            for tok in [self.student, *self.teachers]
        ]
        self.progress = progress.sink_for(self.progress_dir)
        # the first kernel calls load (or compile) the Numba code: do it here, not in the first
        # batch, so the stage times measure the work (no timers, no counters: this is no input)
        self.timing = False
        s_enc, t_encs = self._encode([_WARMUP])
        als = self._align(s_enc, t_encs)
        text = window_batch.BatchText.from_texts([_WARMUP])
        student, teachers = self._sides(s_enc, t_encs, als)
        cut = self._cut(
            text, student, teachers, window_batch.RowPlan.whole(text, np.ones(1, np.bool_))
        )
        zeros = np.zeros(1, np.int64)
        self._rows(cut, text, student, teachers, doc_ids=["w"], char_base=zeros, window_base=zeros)
        self.timing = True
        worker_state.settle_long_lived()

    def _timer(self, stage: str):
        return StageTimer(stage) if self.timing else contextlib.nullcontext()

    def start_bundle(self):
        worker_state.BUNDLES.started()

    def finish_bundle(self):
        worker_state.BUNDLES.finished()

    def _encode(self, texts: list[str]):
        try:
            with self._timer("tokenize"):
                if not worker_state.BUNDLES.spare():
                    return self.student.encode_batch(texts), [
                        t.encode_batch(texts) for t in self.teachers
                    ]
                count("batches_encoded_beside")
                helper = worker_state.BUNDLES.helper()
                futures = [helper.submit(t.encode_batch, texts) for t in self.teachers]
                try:
                    s_enc = self.student.encode_batch(texts)
                finally:  # a failing student waits for its teachers: no encoding outlives its batch
                    wait(futures)
                return s_enc, [f.result() for f in futures]
        except Exception as e:  # noqa: BLE001 - a tokenizer failure is the document's dead letter
            raise _StageError(TOKENIZER_ERROR, e) from e

    def _align(self, s_enc, t_encs):
        with self._timer("align"):
            return [
                align_batch_flat(s_enc, t, student_bytes=self.student_bytes, teacher_bytes=tb)
                for t, tb in zip(t_encs, self.teacher_bytes)
            ]

    def _sides(self, s_enc, t_encs, als):
        (sb, se), *ts = self.specials
        student = window_batch.Side(s_enc.ids, s_enc.row_splits, sb, se)
        teachers = [
            (window_batch.Side(e.ids, e.row_splits, b, x), al)
            for e, (b, x), al in zip(t_encs, ts, als)
        ]
        return student, teachers

    def _cut(self, text, student, teachers, plan):
        with self._timer("windows"):
            return window_batch.cut_batch(
                text,
                student,
                teachers,
                max_student_tokens=self.window.max_student_tokens,
                max_teacher_tokens=self.window.max_teacher_tokens,
                stride_chars=self.window.stride_chars,
                plan=plan,
            )

    def _rows(self, cut, text, student, teachers, *, doc_ids, char_base, window_base):
        with self._timer("to_arrow"):
            return window_batch.to_record_batch(
                cut,
                text,
                student,
                teachers,
                doc_ids=pa.array(doc_ids, pa.string()),
                char_base=char_base,
                window_base=window_base,
                schema=self.schema,
            )

    def _window_stats(self, vec, batch: pa.RecordBatch) -> int:
        """Windows and tokens of `batch` into `vec`; returns all tokens (progress)."""
        lay = self.layout
        lay.add(vec, "windows", batch.num_rows)
        n_s = len(batch.column("student_ids").values)
        n_t = [
            len(batch.column(shard_schema.teacher_ids_column(i)).values)
            for i in range(len(self.teachers))
        ]
        lay.add(vec, "student_tokens", n_s)
        lay.add(vec, "teacher_tokens", n_t)
        return n_s + sum(n_t)

    def process(self, batch: DocBatch):
        limit = self.pieces.piece_chars
        lengths = [len(t) for t in batch.texts]
        per_char = batch.source_bytes / max(sum(lengths), 1)
        short = [i for i, n in enumerate(lengths) if n <= limit]
        if short:
            tokens = yield from self._whole(batch, short)
            if self.progress is not None:
                chars = sum(lengths[i] for i in short)
                self.progress.add(bytes=chars * per_char, documents=len(short), tokens=tokens)
        for i, n in enumerate(lengths):
            if n > limit:
                yield from self._long(batch, i, bytes_per_char=per_char)

    def _whole(self, batch: DocBatch, idx: list[int]):
        """Documents that fit one piece, as one batch; returns the tokens written."""
        ids = [batch.doc_ids[i] for i in idx]
        texts = [batch.texts[i] for i in idx]
        try:
            s_enc, t_encs = self._encode(texts)
        except _StageError:
            # redo one document at a time so only the culprit is dropped
            count("batches_redone_per_document")
            good = []
            for i in idx:
                try:
                    self._encode([batch.texts[i]])
                    good.append(i)
                except _StageError as e:
                    bad = readers.dead_letter(
                        batch.file, e.reason, e.detail, doc_id=batch.doc_ids[i]
                    )
                    yield dead(bad)
            if len(good) < len(idx):
                return (yield from self._whole(batch, good)) if good else 0
            tokens = 0  # each alone is fine, together they fail: go one at a time
            for i in good:
                tokens += yield from self._whole(batch, [i])
            return tokens
        als = self._align(s_enc, t_encs)
        row_ok = np.ones(len(texts), np.bool_)
        for al in als:
            for b in np.flatnonzero(al.row_error):
                if row_ok[b]:
                    yield dead(
                        readers.dead_letter(
                            batch.file, ALIGN_ERROR, _row_error(al, b), doc_id=ids[b]
                        )
                    )
                row_ok[b] = False
        text = window_batch.BatchText.from_texts(texts)
        student, teachers = self._sides(s_enc, t_encs, als)
        cut = self._cut(text, student, teachers, window_batch.RowPlan.whole(text, row_ok))
        n_win = np.diff(cut.win_splits)
        for b in np.flatnonzero(row_ok & (n_win == 0)):
            yield dead(self._no_windows(cut, b, file=batch.file, doc_id=ids[b]))
        zeros = np.zeros(len(texts), np.int64)
        rows = self._rows(
            cut, text, student, teachers, doc_ids=ids, char_base=zeros, window_base=zeros
        )
        vec = self.layout.zeros()
        has = n_win > 0
        self.layout.add(vec, "documents", int(has.sum()))
        for i, al in enumerate(als):
            mask = has[np.repeat(np.arange(len(texts)), np.diff(al.chunk_splits))]
            job_stats.chunk_stats(self.layout, vec, i, al.chunk_kind, al.chunk_exact, mask)
            fb = int(np.count_nonzero((al.fallback_regions > 0) & has))
            vec[self.layout.slices["fallback_documents"].start + i] += fb
            vec[self.layout.slices["dropped_tokens"].start + i] += int(al.dropped_tokens[has].sum())
            if fb:
                count(f"align_fallback_documents.teacher{i}", fb)
        tokens = self._window_stats(vec, rows)
        count("documents_aligned", int(has.sum()))
        count("windows", rows.num_rows)
        yield MAIN, Windows(rows, vec)
        return tokens

    def _no_windows(self, cut, b: int, *, file: str, doc_id: str, partial: bool = False) -> dict:
        kw = {"doc_id": doc_id, "partial": partial}
        status = int(cut.status[b])
        if status == window_kernel.UNCUTTABLE:
            return readers.dead_letter(file, UNCUTTABLE, self._uncut_detail(cut, b), **kw)
        if status == window_kernel.BAD_CHUNKS:
            detail = "alignment chunk ends go backwards; cannot cut windows"
            return readers.dead_letter(file, ALIGN_ERROR, detail, **kw)
        return readers.dead_letter(file, NO_TOKENS, "no tokens on any side", **kw)

    def _uncut_detail(self, cut, b: int, *, base: int = 0) -> str:
        need = cut.err_need[:, b].tolist()
        c0, c1 = int(cut.err_chars[0, b]) + base, int(cut.err_chars[1, b]) + base
        return (
            f"characters [{c0}, {c1}) cannot be cut: the next common chunk boundary needs "
            f"{need[0]} student / {need[1:]} teacher tokens (limits "
            f"{self.window.max_student_tokens} / {self.window.max_teacher_tokens}, BOS/EOS "
            "included)"
        )

    def _long(self, batch: DocBatch, i: int, *, bytes_per_char: float):
        """One long document, piece by piece (`tokenbridge.alignment.long_documents`): one `Windows` per piece."""
        doc_id, text = batch.doc_ids[i], batch.texts[i]
        lay, walk = self.layout, PieceWalk(text, self.pieces)
        n_windows, done_to = 0, 0
        fallback = np.zeros(len(self.teachers), np.bool_)
        count("long_documents")
        for piece in walk:
            where = f" (piece {piece.index}, characters [{piece.start}, {piece.end}))"
            ptext = text[piece.start : piece.end]
            # a piece that fails ends the document: a lost one unless earlier pieces gave windows
            ends = {"doc_id": doc_id, "partial": n_windows > 0}
            try:
                s_enc, t_encs = self._encode([ptext])
            except _StageError as e:
                yield dead(readers.dead_letter(batch.file, e.reason, e.detail + where, **ends))
                break
            als = self._align(s_enc, t_encs)
            bad = [_row_error(al, 0) for al in als if al.row_error[0]]
            if bad:
                yield dead(readers.dead_letter(batch.file, ALIGN_ERROR, bad[0] + where, **ends))
                break
            fallback |= np.array([al.fallback_regions[0] > 0 for al in als])
            ptext_bytes = window_batch.BatchText.from_texts([ptext])
            final = (
                len(ptext_bytes.data)
                if piece.last
                else len(text[piece.start : piece.final_to].encode())
            )
            plan = window_batch.RowPlan(
                np.array([len(text[piece.start : piece.cut_from].encode())], np.int64),
                np.array([final], np.int64),
                np.array([piece.last]),
                np.zeros(1, np.bool_),
                np.ones(1, np.bool_),
            )
            student, teachers = self._sides(s_enc, t_encs, als)
            cut = self._cut(ptext_bytes, student, teachers, plan)
            if cut.status[0] == window_kernel.BAD_CHUNKS:
                yield dead(self._no_windows(cut, 0, file=batch.file, **ends))
                break
            vec = lay.zeros()
            lay.add(vec, "pieces", 1)
            if cut.skipped[0]:
                detail = self._uncut_detail(cut, 0, base=piece.start)
                detail += f"; {int(cut.skipped[0])} span(s) of this piece skipped" + where
                # never the document's loss: if no piece gives windows, NO_TOKENS says so below
                skipped = readers.dead_letter(
                    batch.file, UNCUTTABLE, detail, doc_id=doc_id, partial=True
                )
                yield dead(skipped)
                lay.add(vec, "uncuttable_spans", int(cut.skipped[0]))
            if cut.seam_moved[0]:
                count("seams_moved")
                lay.add(vec, "seams_moved", 1)
            base = np.array([piece.start], np.int64)
            rows = self._rows(
                cut,
                ptext_bytes,
                student,
                teachers,
                doc_ids=[doc_id],
                char_base=base,
                window_base=np.array([n_windows], np.int64),
            )
            n_windows += rows.num_rows
            self._piece_stats(vec, cut, als, s_enc, t_encs)
            tokens = self._window_stats(vec, rows)
            count("windows", rows.num_rows)
            count("pieces")
            nxt = int(cut.next_pos[1, 0])
            next_start = None if piece.last else (piece.start + nxt if nxt >= 0 else piece.end)
            yield MAIN, Windows(rows, vec)
            if self.progress is not None:
                to = piece.end if piece.last else (next_start or piece.end)
                self.progress.add(bytes=(to - done_to) * bytes_per_char, tokens=tokens)
                done_to = max(done_to, to)
            walk.advance(next_start)
        vec = lay.zeros()  # the document itself, once
        if n_windows:
            lay.add(vec, "documents", 1)
            lay.add(vec, "long_documents", 1)
            lay.add(vec, "fallback_documents", fallback.astype(np.int64))
            count("documents_aligned")
        elif walk.finished:
            yield dead(readers.dead_letter(batch.file, NO_TOKENS, "no windows", doc_id=doc_id))
        if self.progress is not None:
            self.progress.add(documents=1)
        yield MAIN, Windows(pa.RecordBatch.from_pylist([], schema=self.schema), vec)

    def _piece_stats(self, vec, cut, als, s_enc, t_encs) -> None:
        """Chunks and dropped tokens of the part of a piece its windows cover (so the overlap
        with the next piece is not counted twice)."""
        lo_s, hi_s = int(cut.kept_tokens[0, 0, 0]), int(cut.kept_tokens[1, 0, 0])
        special_s = self.student_bytes.special
        for i, (al, t_enc) in enumerate(zip(als, t_encs)):
            c0, c1 = int(cut.kept_chunks[0, i, 0]), int(cut.kept_chunks[1, i, 0])
            mask = np.zeros(al.chunk_kind.size, np.bool_)
            mask[c0:c1] = True
            job_stats.chunk_stats(self.layout, vec, i, al.chunk_kind, al.chunk_exact, mask)
            lo_t, hi_t = int(cut.kept_tokens[0, i + 1, 0]), int(cut.kept_tokens[1, i + 1, 0])
            s_free = (al.student_chunk[lo_s:hi_s] < 0) & ~special_s[s_enc.ids[lo_s:hi_s]]
            t_ids = t_enc.ids[lo_t:hi_t]
            t_free = (al.teacher_chunk[lo_t:hi_t] < 0) & ~self.teacher_bytes[i].special[t_ids]
            dropped = int(s_free.sum() + t_free.sum())
            vec[self.layout.slices["dropped_tokens"].start + i] += dropped


def _row_error(al, b: int) -> str:
    try:
        al.row(int(b))
    except AlignmentError as e:
        return str(e)
    return f"row {int(b)}: alignment failed (code {int(al.row_error[b])})"
