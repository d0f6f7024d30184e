"""When most of a job's input dies, the job fails: `dead_verdict`, the finalize steps' question."""

from __future__ import annotations

import pytest

from pipelines.plumbing.tagged import MAX_DEAD_FRACTION, dead_verdict


def test_a_few_dead_rows_complete_and_a_majority_fails():
    assert MAX_DEAD_FRACTION == 0.5
    assert dead_verdict(10, {}, max_fraction=0.5, unit="documents") is None
    assert dead_verdict(6, {"bad_json": 4}, max_fraction=0.5, unit="documents") is None
    why = dead_verdict(4, {"bad_json": 5, "empty_document": 1}, max_fraction=0.5, unit="rows")
    assert why == (
        "6 of 10 rows went to the dead letters (60% > --max-dead-fraction 0.5); "
        "top reasons: bad_json 5, empty_document 1"
    )


@pytest.mark.parametrize("limit", [0.0, 0.5, 1.0])
def test_a_run_where_every_row_died_always_fails(limit):
    why = dead_verdict(0, {"missing_field": 3}, max_fraction=limit, unit="documents")
    assert why == (
        "3 of 3 documents went to the dead letters (every one); top reasons: missing_field 3"
    )


def test_the_top_three_reasons_by_count_then_name():
    dead = {"d": 1, "c": 2, "b": 2, "a": 9}
    why = dead_verdict(0, dead, max_fraction=1.0, unit="rows")
    assert why.endswith("top reasons: a 9, b 2, c 2")
    assert dead_verdict(1, dead, max_fraction=1.0, unit="rows") is None  # the limit allows all
    assert dead_verdict(100, {"x": 1}, max_fraction=0.0, unit="rows") is not None
