"""The projection tables `xtoken` reads: teacher token -> student bucket, student token -> bucket.

Where the teacher is finer (" p","ears" vs " pears"), mapping its " p" to the student's " p"
alone would push the student off its correct " pears", so both sides are pooled into common
buckets named by student tokens (key(s) = g(f(s)), iterated to a fixed point). Definitions:
docs/losses.md, "`xtoken`".

Legend: R teacher rows (lm_head width), P slots per row, Vs student rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class XTokenTables:
    t2s_ids: Tensor  # int64 [R, P] bucket (student id) per slot, -1 = empty slot
    t2s_weights: Tensor  # float32 [R, P], 0 on empty slots, row sums <= 1
    s_key: Tensor | None = None  # int64 [Vs] bucket of every student column; None = identity

    @staticmethod
    def from_arrays(
        t2s_ids,
        t2s_weights,
        *,
        student_vocab_size: int,
        first_only: bool = True,
        s_key=None,
    ) -> XTokenTables:
        """Check and convert (numpy or torch) ``t2s_ids`` / ``t2s_weights`` rows.

        ``first_only`` (default) keeps one slot per row, the heaviest, with weight 1: the student
        token that STARTS the teacher token's text. For `tokenbridge.projection` rows (the j-th
        re-tokenized token weighs 2^-j) the heaviest slot is exactly the first token: it weighs
        1, all the others together < 1. ``first_only=False`` keeps every slot (the continuation
        tokens then get probability at a position that never predicts them). Rows summing to
        more than 1 are scaled down to 1. ``s_key`` ([Vs] student id -> bucket), when given, is
        applied to the slot ids too.
        """
        ids = torch.as_tensor(np.asarray(t2s_ids), dtype=torch.int64)
        w = torch.as_tensor(np.asarray(t2s_weights), dtype=torch.float32)
        if ids.dim() != 2 or ids.shape != w.shape:
            raise ValueError(
                f"t2s_ids {tuple(ids.shape)} and t2s_weights {tuple(w.shape)} must be equal [R, P]"
            )
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise ValueError("t2s_weights must be finite and >= 0")
        if bool((ids >= student_vocab_size).any()):
            r = int((ids >= student_vocab_size).any(1).nonzero()[0, 0])
            raise ValueError(
                f"t2s_ids row {r} holds a student id >= student vocab_size {student_vocab_size}"
            )
        empty = (ids < 0) | (w <= 0)
        ids = ids.masked_fill(empty, -1)
        w = w.masked_fill(empty, 0.0)
        if first_only:
            top_w, top_j = w.max(dim=1, keepdim=True)
            ids = torch.where(top_w > 0, ids.gather(1, top_j), -1)
            w = (top_w > 0).float()
        w = w / w.sum(1, keepdim=True).clamp(min=1.0)
        key = None
        if s_key is not None:
            key = torch.as_tensor(np.asarray(s_key), dtype=torch.int64)
            if key.dim() != 1 or key.numel() < student_vocab_size:
                raise ValueError(f"s_key must be [>= {student_vocab_size}], got {tuple(key.shape)}")
            if bool((key < 0).any()) or bool((key >= key.numel()).any()):
                raise ValueError("s_key entries must be student ids")
            if not bool((key[key] == key).all()):
                raise ValueError("s_key must be idempotent (every bucket is its own key)")
            ids = torch.where(ids >= 0, key[ids.clamp(min=0)], -1)
        return XTokenTables(ids, w, key)

    @staticmethod
    def from_projection(
        projection, *, student_vocab_size: int, first_only: bool = True, coarsen: bool = True
    ) -> XTokenTables:
        """From a `tokenbridge.projection.Projection` (t2s_ids / t2s_weights, s2t_ids / s2t_weights).

        ``coarsen`` (default) pools the student tokens into common buckets (key(s) = g(f(s)),
        g the first ``t2s`` slot and f the first ``s2t`` slot; docs/losses.md, "`xtoken`").
        """
        key = None
        if coarsen:
            key = bucket_keys(
                first_slot(projection.s2t_ids, projection.s2t_weights),
                first_slot(projection.t2s_ids, projection.t2s_weights),
            )
        return XTokenTables.from_arrays(
            projection.t2s_ids,
            projection.t2s_weights,
            student_vocab_size=student_vocab_size,
            first_only=first_only,
            s_key=key,
        )

    def members(self) -> tuple[Tensor, Tensor]:
        """(ids, keys) of the pooled student tokens: those whose bucket is another token."""
        if self.s_key is None:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty
        ids = torch.arange(self.s_key.numel(), device=self.s_key.device)
        pooled = (self.s_key != ids).nonzero().squeeze(1)
        return pooled, self.s_key[pooled]

    def to(self, device) -> XTokenTables:
        key = None if self.s_key is None else self.s_key.to(device)
        return XTokenTables(self.t2s_ids.to(device), self.t2s_weights.to(device), key)


def first_slot(ids, weights) -> np.ndarray:
    """Per row, the id of the heaviest non-empty slot, or -1."""
    ids = np.asarray(ids, dtype=np.int64)
    w = np.where(ids >= 0, np.asarray(weights, dtype=np.float64), 0.0)
    j = w.argmax(axis=1)
    rows = np.arange(ids.shape[0])
    return np.where(w[rows, j] > 0, ids[rows, j], -1)


def bucket_keys(f_s2t: np.ndarray, g_t2s: np.ndarray) -> np.ndarray:
    """[Vs] key(s): g(f(s)) iterated to a fixed point (identity where a map is missing)."""
    n = f_s2t.shape[0]
    key = np.arange(n, dtype=np.int64)
    f = f_s2t
    ok = (f >= 0) & (f < g_t2s.shape[0])
    back = np.where(ok, g_t2s[np.clip(f, 0, max(g_t2s.shape[0] - 1, 0))], -1)
    ok &= (back >= 0) & (back < n)
    key[ok] = back[ok]
    for _ in range(64):
        # two byte-identical student tokens may point at each other: keep the smaller id
        swap = (key[key] == np.arange(n)) & (key != np.arange(n))
        key[swap] = np.minimum(key[swap], np.arange(n)[swap])
        nxt = key[key]
        if np.array_equal(nxt, key):
            return key
        key = nxt
    raise ValueError("bucket keys did not reach a fixed point (cyclic projection rows)")
