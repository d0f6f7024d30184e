"""Conversations against the window limits: refuse the long ones, or keep their latest turns.

A shard row is one whole conversation, never cut inside a turn. Over a side's limit it is a
`TOO_LONG` dead letter, or with ``keep_suffix`` the system turn plus the longest suffix of whole
turns that fits every side, rendered again by every template (docs/alignment.md,
"Conversations").
"""

from __future__ import annotations

import numpy as np

from tokenbridge.chat import rows
from tokenbridge.chat.rows import Conversation, DeadLetter

TOO_LONG, KEEP_SUFFIX = "too_long", "keep_suffix"
OVERFLOW_MODES = (TOO_LONG, KEEP_SUFFIX)


def lengths(batch) -> np.ndarray:
    """int64 [1 + K, B]: tokens of every conversation of a `ChatBatch`, student then teachers."""
    sides = [batch.student, *batch.teachers]
    return np.stack([np.diff(s.token_splits) for s in sides]).astype(np.int64)


def over(n: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """bool [B]: a side of the conversation has more tokens than its limit."""
    return (n > limits[:, None]).any(axis=0)


def too_long(n: np.ndarray, limits: np.ndarray, *, kept: bool = False) -> DeadLetter:
    """The dead letter of a conversation with per-side token counts `n` [1 + K]."""
    what = "no suffix of whole turns fits either: " if kept else ""
    return DeadLetter(
        rows.TOO_LONG,
        "messages",
        f"{what}{int(n[0])} student / {n[1:].tolist()} teacher tokens, limits "
        f"{int(limits[0])} / {limits[1:].tolist()} (--max-student-tokens, --max-teacher-tokens; "
        f"--long-conversations {KEEP_SUFFIX} keeps the latest turns that fit)",
    )


def message_tokens(batch, b: int) -> np.ndarray:
    """int64 [1 + K, m]: tokens each side spends on each message of conversation b (its turn:
    open marker, header, content, end of turn)."""
    out = []
    for side in (batch.student, *batch.teachers):
        r = side.row(b)
        m = r.spans.shape[0]
        msg = r.message[r.message >= 0]
        out.append(np.bincount(msg, minlength=m)[:m])
    return np.stack(out).astype(np.int64)


def head(conv: Conversation) -> int:
    """1 when the conversation starts with a system turn (always kept), else 0."""
    return int(bool(conv.messages) and conv.messages[0].role == "system")


def candidates(conv: Conversation, *, train_on: str) -> list[int]:
    """Start indices k of the suffixes that may be kept, longest first: a user turn after the
    first message (after the system turn, if any), whose suffix holds a turn to train on."""
    msgs = conv.messages
    out = []
    for k in range(head(conv) + 1, len(msgs)):
        if msgs[k].role != "user":
            continue
        if train_on != rows.TRAIN_ALL and not any(m.trainable for m in msgs[k:]):
            continue
        out.append(k)
    return out


def suffix(conv: Conversation, k: int) -> Conversation:
    """The system turn (if first) plus messages k.. of `conv`."""
    return Conversation((*conv.messages[: head(conv)], *conv.messages[k:]))


def next_candidate(
    starts: list[int],
    tried: int,
    *,
    per_message: np.ndarray,
    n: np.ndarray,
    limits: np.ndarray,
    first: int,
) -> int | None:
    """Index into `starts` of the longest candidate after `tried` (-1: none yet) whose
    estimated length fits: the full length `n` [1 + K] minus the tokens of the dropped
    messages [first, start) (`per_message`, from `message_tokens`); None if none does."""
    for j in range(tried + 1, len(starts)):
        dropped = per_message[:, first : starts[j]].sum(axis=1)
        if np.all(n - dropped <= limits):
            return j
    return None
