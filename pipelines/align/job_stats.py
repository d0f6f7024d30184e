"""The align job's statistics as one int64 vector per batch, summed, then stats.json.

A batch of documents adds a fixed-layout vector (documents, windows, tokens per side, chunk
kinds and exact chunks per teacher, ...), so combining the statistics of a million documents is
a million vector additions in the batches that hold them, not a recursive merge of dicts per
document. `final_stats` turns the sum into stats.json.
"""

from __future__ import annotations

import numpy as np

from tokenbridge.chat.edges import REWRITES

CHUNK_KIND_NAMES = ("1:1", "1:N", "N:1", "N:M")  # student:teacher tokens, alignment.CHUNK_* order


class StatsLayout:
    """Where each statistic lives in the vector, for `n_teachers` teachers."""

    SCALARS = (
        "documents",
        "windows",
        "student_tokens",
        "long_documents",
        "pieces",
        "seams_moved",
        "uncuttable_spans",
        "trained_tokens",  # conversations: student tokens with a train code
        "trained_bytes",  # conversations: UTF-8 bytes of the trained contents
        "truncated_conversations",  # conversations: kept as their latest turns (keep_suffix)
    )
    PER_TEACHER = (
        "teacher_tokens",
        "exact_chunks",
        "fallback_documents",
        "dropped_tokens",
        "loose_tokens",  # conversations: content tokens in no chunk (they straddle an edge)
        "eot_pairs",  # conversations: end-of-turn pairs
        "open_pairs",  # conversations: turn-open marker pairs
    )

    def __init__(self, n_teachers: int):
        self.n = n_teachers
        at = 0
        self.slices: dict[str, slice] = {}
        for name in self.SCALARS:
            self.slices[name] = slice(at, at + 1)
            at += 1
        for name in self.PER_TEACHER:
            self.slices[name] = slice(at, at + n_teachers)
            at += n_teachers
        self.slices["chunk_kinds"] = slice(at, at + 4 * n_teachers)
        at += 4 * n_teachers
        # conversations: contents per side (student, teachers) by rewrite (edges.REWRITES)
        self.slices["content_rewrites"] = slice(at, at + len(REWRITES) * (1 + n_teachers))
        self.size = at + len(REWRITES) * (1 + n_teachers)

    def zeros(self) -> np.ndarray:
        return np.zeros(self.size, np.int64)

    def add(self, vec: np.ndarray, name: str, value) -> None:
        vec[self.slices[name]] += np.asarray(value, np.int64).reshape(-1)

    def get(self, vec: np.ndarray, name: str) -> np.ndarray:
        return vec[self.slices[name]]

    def scalar(self, vec: np.ndarray, name: str) -> int:
        return int(vec[self.slices[name]][0])


def chunk_stats(layout: StatsLayout, vec, i: int, kind: np.ndarray, exact: np.ndarray, mask):
    """Add teacher i's chunks selected by `mask` (kinds and exact ones) to `vec`."""
    at = layout.slices["chunk_kinds"].start + 4 * i
    vec[at : at + 4] += np.bincount(kind[mask].astype(np.int64), minlength=4)[:4]
    vec[layout.slices["exact_chunks"].start + i] += int(np.count_nonzero(exact[mask]))


def final_stats(
    header: dict, vec: np.ndarray | None, dropped: dict, files: dict[str, int], *, lost: int
) -> dict:
    """stats.json: the run's header (tokenizers, config) plus totals over all documents.
    `dropped`: dead letters by reason; `lost`: how many of them were documents (or input rows,
    files) that gave no window, the rest being parts of documents that did."""
    n_t = len(header["teachers"])
    layout = StatsLayout(n_t)
    vec = layout.zeros() if vec is None else vec
    docs = layout.scalar(vec, "documents")
    kinds = layout.get(vec, "chunk_kinds").reshape(n_t, 4)
    chunks = [int(k.sum()) for k in kinds]
    exact = layout.get(vec, "exact_chunks")
    fallback = layout.get(vec, "fallback_documents")
    out = {
        **header,
        "documents": docs,
        "windows": layout.scalar(vec, "windows"),
        "rows": int(sum(files.values())),
        "shards": len(files),
        "tokens": {
            "student": layout.scalar(vec, "student_tokens"),
            "teachers": [int(x) for x in layout.get(vec, "teacher_tokens")],
        },
        "chunks": chunks,
        "chunk_kinds": [dict(zip(CHUNK_KIND_NAMES, map(int, k))) for k in kinds],
        "exact_chunk_fraction": [int(e) / c if c else 0.0 for e, c in zip(exact, chunks)],
        "fallback_documents": [int(f) for f in fallback],
        "fallback_rate": [int(f) / docs if docs else 0.0 for f in fallback],
        "dropped_tokens": [int(x) for x in layout.get(vec, "dropped_tokens")],
        "long_documents": layout.scalar(vec, "long_documents"),
        "pieces": layout.scalar(vec, "pieces"),
        "seams_moved": layout.scalar(vec, "seams_moved"),
        "uncuttable_spans": layout.scalar(vec, "uncuttable_spans"),
        "dead_letters": int(sum(dropped.values())),
        "drops_by_reason": dict(sorted((k, int(v)) for k, v in dropped.items())),
        "documents_lost": int(lost),
    }
    if "chat" in header:  # a conversation job: what only conversations have
        per_side = layout.get(vec, "content_rewrites").reshape(1 + n_t, len(REWRITES))
        rewrites = [dict(zip(REWRITES, map(int, r))) for r in per_side]
        out["chat"] = {
            **header["chat"],
            "conversations": docs,
            "truncated_conversations": layout.scalar(vec, "truncated_conversations"),
            "trained_tokens": layout.scalar(vec, "trained_tokens"),
            "trained_bytes": layout.scalar(vec, "trained_bytes"),
            "loose_tokens": [int(x) for x in layout.get(vec, "loose_tokens")],
            "eot_pairs": [int(x) for x in layout.get(vec, "eot_pairs")],
            "open_pairs": [int(x) for x in layout.get(vec, "open_pairs")],
            # per side, its contents by what its template did to their edge whitespace
            "content_rewrites": {"student": rewrites[0], "teachers": rewrites[1:]},
        }
    return out
