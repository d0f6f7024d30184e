"""Which student tokens are trained: the per-token train flag of a conversation.

A flag on token t makes it a *target*: CE and every KD mode apply at the position that predicts
it, and counts follow the flags. Modes (`rows.TRAIN_MODES`): ``assistant`` (default: trainable
assistant contents and their end-of-turn runs), ``last_assistant``, ``all`` (docs/alignment.md,
"Conversations").
"""

from __future__ import annotations

import numpy as np

from tokenbridge.chat import rows
from tokenbridge.chat.markers import TOKEN_CLOSE, TOKEN_CONTENT, Layout, fill_ranges
from tokenbridge.chat.rows import Conversation
from tokenbridge.formats import shard_schema


def picked_messages(convs: list[Conversation], *, train_on: str) -> np.ndarray:
    """bool [M] over the batch's messages (flat, in order): the turns that are trained."""
    if train_on not in rows.TRAIN_MODES:
        raise ValueError(f"train_on must be one of {rows.TRAIN_MODES}, got {train_on!r}")
    flags = []
    for c in convs:
        f = [m.trainable for m in c.messages]
        if train_on == rows.TRAIN_LAST and any(f):
            last = len(f) - 1 - f[::-1].index(True)
            f = [k == last for k in range(len(f))]
        flags.extend(f)
    return np.array(flags, bool)


def train_flags(convs: list[Conversation], lay: Layout, *, train_on: str) -> np.ndarray:
    """bool [N] over the student's tokens of a batch (see the module docstring)."""
    if train_on == rows.TRAIN_ALL:
        return np.ones(lay.kind.size, bool)
    picked = picked_messages(convs, train_on=train_on)
    flags = np.zeros(lay.kind.size, bool)
    fill_ranges(lay.content[picked, 0], lay.content[picked, 1], True, flags)
    closed = picked & (lay.close[:, 0] >= 0)
    fill_ranges(lay.close[closed, 0], lay.close[closed, 1], True, flags)
    return flags


def side_flags(side, picked: np.ndarray, *, train_on: str) -> np.ndarray:
    """bool [N] over any side's tokens (a `SideBatch`): the same rule as `train_flags`, read
    from the side's per-token message and kind (teachers get the flags their student has, for
    their own tokens: a teacher's held-out bits per byte counts the same contents)."""
    if train_on == rows.TRAIN_ALL:
        return np.ones(side.kind.size, bool)
    row = np.repeat(np.arange(side.token_splits.size - 1), np.diff(side.token_splits))
    glob = side.span_splits[row] + np.maximum(side.message, 0)
    in_msg = side.message >= 0
    chosen = np.zeros(side.kind.size, bool)
    chosen[in_msg] = picked[glob[in_msg]]
    return chosen & ((side.kind == TOKEN_CONTENT) | (side.kind == TOKEN_CLOSE))


def train_codes(flags: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """int8 [N] shard train codes (`tokenbridge.formats.shard_schema.TRAIN_*`) from flags and token kinds."""
    codes = np.where(kind == TOKEN_CONTENT, shard_schema.TRAIN_CONTENT, shard_schema.TRAIN_OTHER)
    codes = np.where(kind == TOKEN_CLOSE, shard_schema.TRAIN_END_OF_TURN, codes)
    return np.where(flags, codes, shard_schema.TRAIN_NONE).astype(np.int8)
