"""The align job's conversation path: DoFns that read conversation rows and make shard rows.

Each batch goes through the pure core of `tokenbridge.chat` (parse, render and align every
side, fit to the window limits, Arrow columns) and leaves as the text path's `Windows`, for the
same rolling shard writer; every refused row is a dead letter with file, row, field and reason.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import apache_beam as beam
import numpy as np

from pipelines.align import chat_records, job_stats
from pipelines.align.align_dofns import (
    ALIGN_ERROR,
    BATCH_CHARS,
    MAIN,
    InputSplit,
    StageTimer,
    Windows,
    cached_tokenizer,
    count,
    dead,
)
from pipelines.align.chat_read import Row, read_rows
from pipelines.align.readers import Position
from pipelines.plumbing import progress
from tokenbridge.alignment import WindowConfig
from tokenbridge.chat import fit, rows
from tokenbridge.chat.align import align_conversations, prepare_side
from tokenbridge.chat.rows import Conversation, DeadLetter, Message
from tokenbridge.chat.templates import ChatTemplate
from tokenbridge.formats import shard_schema

BATCH_ROWS = 512  # conversations per alignment batch
MAX_ROUNDS = 8  # keep_suffix: renders of one batch's long conversations before giving up

_WARMUP = Conversation(
    (Message("user", "Warm-up: naïve café?", False), Message("assistant", "日本語, 12.", True))
)


@dataclass(frozen=True)
class ChatConfig:
    """What a conversation job adds to the text job's configuration."""

    student_template: ChatTemplate
    teacher_templates: tuple[ChatTemplate, ...]
    row_format: str | None = None  # rows.MESSAGES / PROMPT_COMPLETION; None: per file
    train_on: str = rows.TRAIN_ASSISTANT
    long_conversations: str = fit.TOO_LONG

    def __post_init__(self) -> None:
        if self.train_on not in rows.TRAIN_MODES:
            raise ValueError(f"train_on must be one of {rows.TRAIN_MODES}, got {self.train_on!r}")
        if self.long_conversations not in fit.OVERFLOW_MODES:
            raise ValueError(
                f"long_conversations must be one of {fit.OVERFLOW_MODES}, "
                f"got {self.long_conversations!r}"
            )

    def header(self) -> dict:
        """What stats.json says of the run (markers come from the shards' metadata)."""
        return {
            "row_format": self.row_format or "per file",
            "train_on": self.train_on,
            "long_conversations": self.long_conversations,
            "templates": {
                "student": self.student_template.to_json(),
                "teachers": [t.to_json() for t in self.teacher_templates],
            },
        }


@dataclass(frozen=True)
class RowBatch:
    """Consecutive conversation rows of one file, aligned together."""

    file: str
    rows: list[Row] = field(default_factory=list)
    source_bytes: int = 0  # input bytes they were read from (progress)


class ReadChatDoFn(beam.DoFn):
    """`InputSplit` -> (MAIN, `RowBatch`) per up to BATCH_ROWS rows; (DEAD, record) per bad
    record or file."""

    def __init__(self, row_format: str | None, *, progress_dir: str | None = None):
        self.row_format, self.progress_dir = row_format, progress_dir

    def process(self, item: InputSplit):
        if item.split.start == 0:
            count("files_read")
        pos = Position()
        batch, reported, n = [], 0, 0
        for x in read_rows(
            item.path, item.doc_id, row_format=self.row_format, split=item.split, pos=pos
        ):
            if not isinstance(x, Row):
                yield dead(x)
                continue
            # jsonl counts its bytes as it reads (parquet at the end: rows only bound it)
            if batch and (len(batch) >= BATCH_ROWS or pos.bytes - reported >= BATCH_CHARS):
                yield MAIN, RowBatch(item.path, batch, pos.bytes - reported)
                reported, batch = pos.bytes, []
            batch.append(x)
            n += 1
        rest = max(item.size - reported, 0)  # parquet counts its bytes at the end
        if batch:
            yield MAIN, RowBatch(item.path, batch, rest)
        else:
            sink = progress.sink_for(self.progress_dir)
            if sink is not None:
                sink.add(bytes=rest)
        count("conversations_read", n)


class AlignChatDoFn(beam.DoFn):
    """`RowBatch` -> (MAIN, `Windows`) of its conversations, (DEAD, record) per refused row."""

    def __init__(
        self,
        student: str,
        teachers: list[str],
        *,
        chat: ChatConfig,
        window: WindowConfig,
        progress_dir: str | None = None,
    ):
        if len(chat.teacher_templates) != len(teachers):
            raise ValueError(
                f"{len(teachers)} teachers but {len(chat.teacher_templates)} teacher templates"
            )
        self.student_path, self.teacher_paths = student, list(teachers)
        self.chat, self.window, self.progress_dir = chat, window, progress_dir

    def setup(self):
        s_tok = cached_tokenizer(self.student_path)
        t_toks = [cached_tokenizer(p) for p in self.teacher_paths]
        self.student = prepare_side(s_tok, self.chat.student_template)
        self.teachers = [
            prepare_side(t, tmpl, name=f"teacher{i} ({t.name})")
            for i, (t, tmpl) in enumerate(zip(t_toks, self.chat.teacher_templates))
        ]
        meta = chat_records.chat_meta(
            self.student,
            self.teachers,
            train_on=self.chat.train_on,
            long_conversations=self.chat.long_conversations,
        )
        self.schema = shard_schema.shard_schema(s_tok.info(), [t.info() for t in t_toks], chat=meta)
        self.layout = job_stats.StatsLayout(len(t_toks))
        w = self.window
        self.limits = np.array(
            [w.max_student_tokens] + [w.max_teacher_tokens] * len(t_toks), np.int64
        )
        self.progress = progress.sink_for(self.progress_dir)
        self.timing = False  # the first calls compile the aligner's Numba code: not timed
        self._align([_WARMUP])
        self.timing = True

    def _timer(self, stage: str):
        return StageTimer(stage) if self.timing else contextlib.nullcontext()

    def _align(self, convs: list[Conversation]) -> list[tuple[object, list[int]]]:
        """[(ChatBatch, the positions in `convs` it covers)]; a batch that raises is redone one
        conversation at a time, and a conversation that raises alone is a dead letter."""
        kw = {"student": self.student, "teachers": self.teachers, "train_on": self.chat.train_on}
        with self._timer("align"):
            try:
                return [(align_conversations(convs, **kw), list(range(len(convs))))]
            except Exception:  # noqa: BLE001 - find the culprit below
                if len(convs) == 1:
                    raise
        count("batches_redone_per_conversation")
        out = []
        for i, c in enumerate(convs):
            try:
                out.append((align_conversations([c], **kw), [i]))
            except Exception as e:  # noqa: BLE001 - one conversation's failure is its dead letter
                out.append((DeadLetter(ALIGN_ERROR, "messages", f"{type(e).__name__}: {e}"), [i]))
        return out

    def process(self, batch: RowBatch):
        convs, where = [], []
        with self._timer("parse"):
            for r in batch.rows:
                c = rows.parse_row(r.value, fmt=r.fmt, train_on=self.chat.train_on)
                if isinstance(c, DeadLetter):
                    yield dead(c.record(file=batch.file, row=r.row, doc_id=r.doc_id))
                else:
                    convs.append(c)
                    where.append(r)
        written, tokens = 0, 0
        pending = [(c, r, None) for c, r in zip(convs, where)]  # (conversation, row, suffix state)
        for _ in range(MAX_ROUNDS):
            if not pending:
                break
            retry: list = []
            for n_rows, n_tokens in (yield from self._round(batch.file, pending, retry)):
                written, tokens = written + n_rows, tokens + n_tokens
            pending = retry
        for _, r, state in pending:  # still too long after MAX_ROUNDS renders
            letter = self._too_long(state["n"], kept=True)
            yield dead(letter.record(file=batch.file, row=r.row, doc_id=r.doc_id))
        count("conversations_aligned", written)
        if self.progress is not None:
            self.progress.add(bytes=batch.source_bytes, documents=len(batch.rows), tokens=tokens)

    def _too_long(self, n, *, kept: bool = False) -> DeadLetter:
        return fit.too_long(n, self.limits, kept=kept)

    def _round(self, file: str, pending: list, retry: list):
        """Align `pending` (conversation, row, suffix state); write the ones that fit, dead-letter
        the refused ones, and put long ones with a candidate left into `retry`. Returns
        [(rows written, tokens)] per aligned batch."""
        results = []
        for cb, idx in self._align([c for c, _, _ in pending]):
            if isinstance(cb, DeadLetter):
                _, r, _ = pending[idx[0]]
                yield dead(cb.record(file=file, row=r.row, doc_id=r.doc_id))
                continue
            for i, letter in cb.dead:
                _, r, _ = pending[idx[i]]
                yield dead(letter.record(file=file, row=r.row, doc_id=r.doc_id))
            live = [pending[idx[int(i)]] for i in cb.index]
            if not live:
                continue
            n = fit.lengths(cb)
            keep = ~fit.over(n, self.limits)
            for b in np.flatnonzero(~keep):
                letter = self._overflow(cb, int(b), live[b], n[:, b], retry=retry)
                if letter is not None:
                    r = live[b][1]
                    yield dead(letter.record(file=file, row=r.row, doc_id=r.doc_id))
            if keep.any():
                with self._timer("to_arrow"):
                    rec = chat_records.record_batch(
                        cb,
                        [c for c, _, _ in live],
                        doc_ids=[r.doc_id for _, r, _ in live],
                        train_on=self.chat.train_on,
                        schema=self.schema,
                    )
                    if not keep.all():  # (take loads pyarrow.compute: ~0.6 s once per process)
                        rec = rec.take(np.flatnonzero(keep))
                vec = self.layout.zeros()
                chat_records.add_stats(self.layout, vec, cb, keep, rec)
                truncated = sum(1 for b in np.flatnonzero(keep) if live[b][2] is not None)
                self.layout.add(vec, "truncated_conversations", truncated)
                if truncated:
                    count("conversations_truncated", truncated)
                count("windows", rec.num_rows)
                yield MAIN, Windows(rec, vec)
                results.append((rec.num_rows, int(n[:, keep].sum())))
        return results

    def _overflow(self, cb, b: int, item, n, *, retry: list) -> DeadLetter | None:
        """A conversation over the limits: its dead letter, or None with its next suffix put
        into `retry` (``--long-conversations keep_suffix``)."""
        conv, r, state = item
        if self.chat.long_conversations == fit.TOO_LONG:
            return self._too_long(n)
        if state is None:  # the whole conversation: its candidates, estimated from this render
            state = {
                "conv": conv,
                "starts": fit.candidates(conv, train_on=self.chat.train_on),
                "per_message": fit.message_tokens(cb, b),
                "n": n,
                "tried": -1,
            }
        j = fit.next_candidate(
            state["starts"],
            state["tried"],
            per_message=state["per_message"],
            n=state["n"],
            limits=self.limits,
            first=fit.head(state["conv"]),
        )
        if j is None:
            return self._too_long(state["n"], kept=bool(state["starts"]))
        state = {**state, "tried": j}
        retry.append((fit.suffix(state["conv"], state["starts"][j]), r, state))
        return None
