"""The run report: plots of one or more run folders in one self-contained HTML page.

``python -m trainer.report`` (``__main__``); the trainer calls ``after_run`` on rank 0 when a run
ends. The public names load lazily, so importing this package (the trainer does, at start-up)
costs nothing; matplotlib is imported only when a chart is drawn. Design: docs/eval.md.
"""

from __future__ import annotations

import importlib

_LAZY = {"write_report": "trainer.report.build", "after_run": "trainer.report.build"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer.report' has no attribute {name!r}")
