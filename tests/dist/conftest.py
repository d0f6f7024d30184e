"""One 4-process gloo launch for the whole multi-process suite (see harness.py).

The session fixture `dist_results` spawns the ranks once, runs every registered case and merges
the ranks' reports: case name -> None (passed on every rank) or the mismatches / tracebacks.
"""

from __future__ import annotations

import pytest

from tests.dist.case_runner import load_cases, run_cases
from tests.dist.harness import WORLD
from trainer.parallel.spawn import spawn


@pytest.fixture(scope="session")
def dist_results() -> dict[str, str | None]:
    names = sorted(load_cases())
    per_rank = spawn(run_cases, world_size=WORLD, args=(names,), timeout_s=120.0)
    merged: dict[str, str | None] = {}
    for name in names:
        errors = [r[name] for r in per_rank if r[name]]
        merged[name] = "\n".join(errors) or None
    return merged
