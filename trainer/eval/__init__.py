"""Evaluation suite: held-out bits per byte and standard benchmarks, offline, side by side.

``python -m trainer.eval --model a[,b] --tasks ... --limit N`` (see ``__main__``); the trainer
calls ``evaluate_bpb`` for its inline eval and may call ``run_tasks`` on a small fixed subset.
Data: ``python -m trainer.eval.datasets fetch`` (``datasets``); tasks and the stable subset
(``tasks``); tokenization and log-likelihood scoring (``loglik``) over batched forward passes
(``engine``); bits per byte (``bpb``); standard errors (``estimates``); generation
(``generation``); the task loop (``runner``); tables (``results``).

The public names load lazily, so ``python -m trainer.eval.datasets fetch`` imports no torch.
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
