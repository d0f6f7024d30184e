"""Each distributed op vs its dense single-process reference, on real gloo process groups.

All cases run in the one launch of conftest.py; each case is its own test item here.
"""

from __future__ import annotations

import pytest

from tests.dist.case_runner import load_cases

# every case of the launch except the loss-library ones (test_loss_invariance.py checks those);
# none is expected to fail: a case that finds a bug fails here, under its own name
OP_CASES = sorted(n for n in load_cases() if not n.startswith("loss_"))

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", OP_CASES)
def test_op_matches_dense_reference(dist_results, name):
    assert dist_results[name] is None, dist_results[name]
