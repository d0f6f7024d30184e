"""Which student tokens are trained: the per-token train flag of a conversation.

A flag on token t means token t is a *target*: CE and every KD mode apply at the position that
predicts it (the trainer shifts by one as for raw text), and counts follow the flags.

Modes (`rows.TRAIN_MODES`):

- ``assistant`` (default): every trainable assistant turn's content tokens (straddling ones
  included: the student must produce them to say the content) and its end-of-turn run (any
  whitespace the template writes before its close token, and the token): the student learns
  to stop. Trainable turns are all assistant turns of a ``messages`` row and the completion's
  assistant turns of a ``prompt_completion`` row;
- ``last_assistant``: only the last trainable assistant turn (multi-turn data whose earlier
  replies come from another model);
- ``all``: every token, scaffolding included (plain language modelling of the rendering).
"""

from __future__ import annotations

import numpy as np

from pipelines.chat import rows
from pipelines.chat.markers import Layout
from pipelines.chat.rows import Conversation


def train_flags(conv: Conversation, lay: Layout, *, train_on: str) -> np.ndarray:
    """bool [n] over the student's tokens (see the module docstring)."""
    n = lay.kind.size
    if train_on == rows.TRAIN_ALL:
        return np.ones(n, bool)
    if train_on not in rows.TRAIN_MODES:
        raise ValueError(f"train_on must be one of {rows.TRAIN_MODES}, got {train_on!r}")
    picked = [k for k, m in enumerate(conv.messages) if m.trainable]
    if train_on == rows.TRAIN_LAST:
        picked = picked[-1:]
    flags = np.zeros(n, bool)
    for k in picked:
        c0, c1 = lay.content[k]
        flags[c0:c1] = True
        if lay.close[k, 0] >= 0:
            flags[lay.close[k, 0] : lay.close[k, 1]] = True
    return flags
