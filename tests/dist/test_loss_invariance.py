"""The invariance matrix: each loss gives the 1-process loss and gradients for every TP x CP x DP.

All cases run in the one launch of conftest.py; each (loss, layout) is its own test item here.
"""

from __future__ import annotations

import pytest

from tests.dist.case_runner import load_cases

LOSS_CASES = sorted(n for n in load_cases() if n.startswith("loss_"))

pytestmark = pytest.mark.slow


def test_matrix_covers_every_layout_up_to_4_processes():
    layouts = {n.rsplit("_", 1)[1] for n in LOSS_CASES}
    grid = [(t, c, d) for t in (1, 2) for c in (1, 2) for d in (1, 2) if t * c * d <= 4]
    assert layouts == {f"tp{t}cp{c}dp{d}" for t, c, d in grid} and len(grid) == 7


@pytest.mark.parametrize("name", LOSS_CASES)
def test_loss_is_layout_invariant(dist_results, name):
    assert dist_results[name] is None, dist_results[name]
