"""Evaluation suite: held-out bits per byte and standard benchmarks, offline, side by side.

``python -m trainer.eval --model a[,b] --tasks ... --limit N`` (see ``__main__``); the trainer
calls ``evaluate_bpb`` for its inline eval and may call ``run_tasks`` on a small fixed subset.
Data: ``python -m trainer.eval.data fetch`` (``data``); tasks and the stable subset (``tasks``);
the batched scorer (``scoring``); bits per byte (``bpb``); standard errors (``metrics``);
generation (``generation``); the task loop (``runner``); tables (``report``).
"""

from trainer.eval.bpb import evaluate_bpb
from trainer.eval.runner import EvalOptions, load_model, run_tasks

__all__ = ["EvalOptions", "evaluate_bpb", "load_model", "run_tasks"]
