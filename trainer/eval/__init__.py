"""Evaluation suite: held-out bits per byte and standard benchmarks, offline, side by side.

``python -m trainer.eval`` runs it (``__main__``); the trainer calls ``evaluate_bpb`` for its
inline eval and may call ``run_tasks`` on a small fixed subset. The public names load lazily, so
``python -m trainer.eval.datasets fetch`` imports no torch. Design: docs/eval.md.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "evaluate_bpb": "trainer.eval.bpb",
    "trained_bpb": "trainer.eval.bpb",
    "run_tasks": "trainer.eval.runner",
    "load_model": "trainer.eval.runner",
    "EvalOptions": "trainer.eval.runner",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer.eval' has no attribute {name!r}")
