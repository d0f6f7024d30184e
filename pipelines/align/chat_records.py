"""Aligned conversations -> shard rows (Arrow), column by column, and their statistics.

One row per conversation. Every list column is one Arrow ``ListArray`` over the flat per-token
arrays of a `ChatBatch` and their row splits, and the rows that fit are one ``take``: no Python
per row or per token. The columns are the text shards' (``text`` is the student's rendering)
plus the conversation columns of `tokenbridge.formats.shard_schema`; `chat_meta` is what the
file metadata and stats.json record of the sides (templates, turn markers, the train mode).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from pipelines.align import job_stats
from tokenbridge.chat import rows
from tokenbridge.chat.edges import REWRITES, rewrite_kinds
from tokenbridge.chat.train_flags import picked_messages, side_flags, train_codes
from tokenbridge.formats import shard_schema


def chat_meta(student, teachers, *, train_on: str, long_conversations: str) -> dict:
    """The ``tokenbridge.chat`` metadata of a job's shards (`ChatSide`s of the job)."""

    def side(s) -> dict:
        d = s.to_json()
        return {"template": d["template"], "markers": d["markers"], "name": s.name}

    return {
        "train_on": train_on,
        "long_conversations": long_conversations,
        "student": side(student),
        "teachers": [side(t) for t in teachers],
    }


def _lists(splits: np.ndarray, values: np.ndarray, kind: pa.DataType) -> pa.Array:
    offsets = pa.array(np.asarray(splits, np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.asarray(values), type=kind))


def picked(convs: list, *, train_on: str) -> np.ndarray:
    """bool [M] over the batch's messages: the turns that are trained (all, for ``all``)."""
    if train_on == rows.TRAIN_ALL:
        return np.ones(sum(len(c.messages) for c in convs), bool)
    return picked_messages(convs, train_on=train_on)


def record_batch(
    batch, convs: list, *, doc_ids: list[str], train_on: str, schema: pa.Schema
) -> pa.RecordBatch:
    """The shard rows of every conversation of a `ChatBatch` (`convs`: its live conversations,
    in its row order; `doc_ids` likewise)."""
    n = len(batch)
    s = batch.student
    chosen = picked(convs, train_on=train_on)
    content_bytes = np.array(
        [len(m.content.encode("utf-8")) for c in convs for m in c.messages], np.int64
    )
    # the bytes the student's rendering shows: less edge whitespace its template left out
    content_bytes = content_bytes - s.cut.sum(axis=1) if content_bytes.size else content_bytes
    per_msg = np.where(chosen, content_bytes, 0)
    trained_bytes = np.add.reduceat(per_msg, s.span_splits[:-1]) if per_msg.size else per_msg
    trained_bytes = np.where(np.diff(s.span_splits) > 0, trained_bytes, 0)
    text_len = np.array([len(t) for t in s.texts], np.int64)
    cols = {
        "doc_id": pa.array(doc_ids, pa.string()),
        "window": pa.array(np.zeros(n, np.int32)),
        "char_start": pa.array(np.zeros(n, np.int64)),
        "char_end": pa.array(text_len),
        "text": pa.array(s.texts, pa.string()),
        "student_ids": _lists(s.token_splits, s.ids, pa.int32()),
        shard_schema.MESSAGES_COLUMN: pa.array(
            [json.dumps([m.as_dict() for m in c.messages], ensure_ascii=False) for c in convs],
            pa.string(),
        ),
        shard_schema.TRAINED_BYTES_COLUMN: pa.array(trained_bytes.astype(np.int64)),
        shard_schema.STUDENT_TRAIN_COLUMN: _lists(
            s.token_splits, train_codes(batch.train, s.kind), pa.int8()
        ),
    }
    for i, (t, p) in enumerate(zip(batch.teachers, batch.pairs)):
        t_codes = train_codes(side_flags(t, chosen, train_on=train_on), t.kind)
        cols[shard_schema.teacher_ids_column(i)] = _lists(t.token_splits, t.ids, pa.int32())
        cols[shard_schema.teacher_chunk_column(i)] = _lists(
            t.token_splits, p.teacher_chunk, pa.int32()
        )
        cols[shard_schema.teacher_student_chunk_column(i)] = _lists(
            s.token_splits, p.student_chunk, pa.int32()
        )
        cols[shard_schema.teacher_n_chunks_column(i)] = pa.array(
            np.diff(p.chunk_splits).astype(np.int32)
        )
        cols[shard_schema.teacher_train_column(i)] = _lists(t.token_splits, t_codes, pa.int8())
        cols[shard_schema.teacher_chunk_kind_column(i)] = _lists(
            p.chunk_splits, p.chunk_kind, pa.int8()
        )
    missing = [f.name for f in schema if f.name not in cols]
    if missing:
        raise ValueError(f"no values for shard column(s) {missing}")
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


def add_stats(
    layout: job_stats.StatsLayout, vec: np.ndarray, batch, keep: np.ndarray, rec: pa.RecordBatch
) -> None:
    """Statistics of the rows `keep` [B] of a `ChatBatch` (written as `rec`) into `vec`:
    conversations, tokens, trained tokens and bytes, text chunks by kind, fallbacks, loose
    content tokens, turn-marker pairs, and per side the contents' rewrites (`edges.REWRITES`)."""
    layout.add(vec, "documents", int(keep.sum()))
    layout.add(vec, "windows", rec.num_rows)
    layout.add(vec, "student_tokens", int(np.diff(batch.student.token_splits)[keep].sum()))
    layout.add(
        vec, "teacher_tokens", [int(np.diff(t.token_splits)[keep].sum()) for t in batch.teachers]
    )
    codes = rec.column(shard_schema.STUDENT_TRAIN_COLUMN).values.to_numpy(zero_copy_only=False)
    layout.add(vec, "trained_tokens", int(np.count_nonzero(codes)))
    trained = rec.column(shard_schema.TRAINED_BYTES_COLUMN).to_numpy(zero_copy_only=False)
    layout.add(vec, "trained_bytes", int(trained.sum()))
    kinds = []
    for side in (batch.student, *batch.teachers):
        kept = np.repeat(keep, np.diff(side.span_splits))
        kinds.append(np.bincount(rewrite_kinds(side.cut)[kept], minlength=len(REWRITES)))
    layout.add(vec, "content_rewrites", np.concatenate(kinds))
    for i, p in enumerate(batch.pairs):
        row = np.repeat(np.arange(len(batch)), np.diff(p.chunk_splits))
        mine = keep[row]
        job_stats.chunk_stats(
            layout, vec, i, p.chunk_kind, p.chunk_exact, mine & (p.chunk_kind < 4)
        )
        per_teacher = {
            "fallback_documents": np.count_nonzero(keep & (p.fallback_regions > 0)),
            "loose_tokens": p.loose[keep].sum(),
            "eot_pairs": np.count_nonzero(mine & (p.chunk_kind == shard_schema.CHUNK_EOT)),
            "open_pairs": np.count_nonzero(mine & (p.chunk_kind == shard_schema.CHUNK_OPEN)),
        }
        for name, value in per_teacher.items():
            vec[layout.slices[name].start + i] += int(value)
