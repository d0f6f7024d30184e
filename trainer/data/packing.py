"""Packed rows: several short documents per row, in lockstep on the student's and every
teacher's side (``data.packing``).

A conversation shard's rows are short and uneven, so padding each microbatch to its longest row
spends much of a step on padding. `best_fit` picks, from a bounded buffer of documents (oldest
first), the oldest and then the longest that still fit one row of every side's length limit;
`pack_row` concatenates them into one row in the shard-row format `collate` reads: every
teacher's documents in the same order, chunk ids offset per document (no chunk spans two), and
each side's document lengths, from which `collate` restarts position ids and drops the target
crossing each boundary. `PackedLoader` streams packed microbatches, resumable: its state is the
stream's position plus the buffered row ids. docs/training.md, "Packed rows".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainer.data.microbatches import Microbatch, MicrobatchLoader, collate
from trainer.data.shard_reader import ShardStream


@dataclass(frozen=True)
class PackLimits:
    """The most tokens one packed row may hold: the student's and each teacher's."""

    student: int
    teachers: tuple[int, ...]

    def sides(self) -> tuple[int, ...]:
        return (self.student, *self.teachers)


def teacher_limits(packed_tokens: int, *, student_max: int, teacher_max: Sequence[int]) -> tuple:
    """Each teacher's row limit: the student's scaled by the ratio of the longest rows (rounded
    up), never below the teacher's longest row (so every document fits a row alone on every
    side)."""
    return tuple(max(t, -(-packed_tokens * t // max(student_max, 1))) for t in teacher_max)


def row_lengths(row: dict) -> tuple[int, ...]:
    """A shard row's token count on every side: (student, teacher 0, teacher 1, ...)."""
    return (len(row["student_ids"]), *(len(t["ids"]) for t in row["teachers"]))


def best_fit(lengths: Sequence[Sequence[int]], limits: PackLimits) -> list[int]:
    """Indices into ``lengths`` (buffered documents, oldest first) of one packed row, ascending:
    the oldest always joins (no document waits forever), then, while one fits the space left on
    every side, the longest student side that does (the oldest of equals). Taking the longest
    that fits leaves less space unfilled than taking documents in order (first-fit): the rows
    come out fuller, so fewer rows carry the same documents. A document over a limit alone is
    an error."""
    caps = np.asarray(limits.sides(), dtype=np.int64)
    lens_NS = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), len(caps))
    if bool((lens_NS[0] > caps).any()):
        raise ValueError(
            f"a document of {lens_NS[0].tolist()} tokens (student, teachers) does not fit a "
            f"packed row of {list(limits.sides())}: raise data.packed_tokens"
        )
    used = lens_NS[0].copy()
    free = np.ones(len(lens_NS), dtype=bool)
    free[0] = False
    while True:
        fits = free & (used + lens_NS <= caps).all(axis=1)
        if not fits.any():
            break
        i = int(np.argmax(np.where(fits, lens_NS[:, 0], -1)))  # argmax: the first of equals
        free[i] = False
        used += lens_NS[i]
    return np.flatnonzero(~free).tolist()


def pack_documents(
    lengths: Sequence[Sequence[int]], limits: PackLimits, *, buffer: int
) -> list[list[int]]:
    """Every document of a finite sequence, packed into rows as `PackedLoader` packs its stream
    (a buffer of ``buffer`` documents refilled in order, `best_fit`), the last rows with
    whatever is left: lists of indices into ``lengths``, one per row."""
    rows: list[list[int]] = []
    held: list[int] = []
    nxt = 0
    while nxt < len(lengths) or held:
        while len(held) < buffer and nxt < len(lengths):
            held.append(nxt)
            nxt += 1
        picked = best_fit([lengths[i] for i in held], limits)
        rows.append([held[i] for i in picked])
        held = [d for i, d in enumerate(held) if i not in set(picked)]
    return rows


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def _offset_chunks(chunk: np.ndarray, offset: int) -> np.ndarray:
    c = np.asarray(chunk, dtype=np.int64)
    return np.where(c >= 0, c + offset, -1)


def pack_row(docs: list[dict]) -> dict:
    """One packed row (shard-row format, `ShardReader.row`) from documents in order, plus
    ``doc_lens`` (student tokens per document) and, per teacher, its own ``doc_lens``. Chunk ids
    of document d are offset by the chunks of the documents before it, per teacher."""
    out = {
        "student_ids": _cat([d["student_ids"] for d in docs]),
        "text": "".join(d["text"] for d in docs),
        "doc_lens": [len(d["student_ids"]) for d in docs],
        "teachers": [],
    }
    if "train" in docs[0]:
        out["train"] = _cat([d["train"] for d in docs])
        out["trained_bytes"] = sum(int(d["trained_bytes"]) for d in docs)
    for k in range(len(docs[0]["teachers"])):
        side = [d["teachers"][k] for d in docs]
        offsets = np.cumsum([0] + [int(t["n_chunks"]) for t in side])
        t_out = {
            "ids": _cat([t["ids"] for t in side]),
            "chunk": _cat([_offset_chunks(t["chunk"], o) for t, o in zip(side, offsets)]),
            "student_chunk": _cat(
                [_offset_chunks(t["student_chunk"], o) for t, o in zip(side, offsets)]
            ),
            "n_chunks": int(offsets[-1]),
            "doc_lens": [len(t["ids"]) for t in side],
        }
        if "chunk_kind" in side[0]:
            t_out["chunk_kind"] = _cat([t["chunk_kind"] for t in side])
            t_out["train"] = _cat([t["train"] for t in side])
        out["teachers"].append(t_out)
    return out


class PackedLoader(MicrobatchLoader):
    """Microbatches of `micro_batch_size` packed rows (`best_fit` over a buffer of ``buffer``
    documents from the stream, `pack_row`). Checkpointable like `MicrobatchLoader`: the state
    adds the buffered row ids, re-read on load."""

    def __init__(self, stream: ShardStream, *, limits: PackLimits, buffer: int, **kwargs):
        super().__init__(stream, **kwargs)
        self.limits, self.buffer_size = limits, buffer
        self.buffer: list[int] = []  # global row ids, oldest first
        self._lens: dict[int, tuple[int, ...]] = {}

    def _fill(self) -> None:
        while len(self.buffer) < self.buffer_size:
            self.buffer.append(self.stream.next_row())

    def _length(self, row: int) -> tuple[int, ...]:
        if row not in self._lens:
            self._lens[row] = row_lengths(self.stream.reader.row(row))
        return self._lens[row]

    def next_docs(self) -> list[int]:
        """The row ids of the next packed row, taken out of the buffer."""
        self._fill()
        picked = best_fit([self._length(r) for r in self.buffer], self.limits)
        ids = [self.buffer[i] for i in picked]
        taken = set(picked)
        self.buffer = [r for i, r in enumerate(self.buffer) if i not in taken]
        for r in ids:
            self._lens.pop(r, None)
        return ids

    def __next__(self) -> Microbatch:
        groups = [self.next_docs() for _ in range(self.micro_batch_size)]
        reader = self.stream.reader
        rows = [pack_row([reader.row(i) for i in g]) for g in groups]
        return collate(
            rows,
            student_pad=self.student_pad,
            teacher_pads=self.teacher_pads,
            pad_to_multiple=self.pad_to_multiple,
            row_ids=[i for g in groups for i in g],
        )

    def state_dict(self) -> dict:
        # the buffered row ids ride in the stream's position (what a checkpoint stores per rank)
        return {"position": {**self.stream.state_dict(), "pack_buffer": list(self.buffer)}}

    def load_state_dict(self, state: dict) -> None:
        position = dict(state["position"])
        self.buffer = [int(r) for r in position.pop("pack_buffer", [])]
        self.stream.load_state_dict(position)
        self._lens = {}

    def reshard(self, saved: list[dict]) -> str | None:
        held = sum(len(s.get("pack_buffer", [])) for s in saved)
        note = self.stream.reshard(
            [{k: v for k, v in s.items() if k != "pack_buffer"} for s in saved]
        )
        self.buffer, self._lens = [], {}
        if held:
            skipped = f"the {held} documents held in packing buffers are skipped"
            return f"{note}; {skipped}" if note else f"data: {skipped}"
        return note
