"""The non-finite guard of the loop: a NaN loss or gradient norm stops the run with a message
naming the step, the term and the last good checkpoint, or, with ``optim.skip_nonfinite``, skips
that step (no update) and trains on. One process runs every case (tests/e2e/nonfinite_cases.py);
which term a message names is checked on the pure function (tests/unit/test_step_metrics.py).
"""

from __future__ import annotations

import json
import math

import pytest

from bench.common import shakespeare_docs
from tests.e2e.nonfinite_cases import NAN_STEP
from tokenbridge.alignment.text_shards import write_text_shards

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(zygote, tmp_path_factory, student_dir) -> dict:
    tmp = tmp_path_factory.mktemp("nonfinite")
    shards = write_text_shards(
        tmp / "shards",
        shakespeare_docs(8, chars=600),
        student_dir=student_dir,
        teacher_dirs=[student_dir],
        max_tokens=64,
    )
    out = tmp / "report.json"
    proc = zygote.run(["-m", "tests.e2e.nonfinite_cases", str(shards), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_a_nan_stops_the_run_naming_step_term_and_checkpoint(report):
    stop = report["stop"]
    assert stop["error"] is not None, "the run went on through a NaN"
    msg = stop["error"]
    assert msg.startswith(f"step {NAN_STEP}: non-finite CE (nan)"), msg
    assert "the gradient norm (nan)" in msg
    assert f"checkpoints/step-{NAN_STEP - 1:08d}" in msg and "optim.skip_nonfinite=true" in msg
    assert stop["step"] == NAN_STEP - 1  # the bad step was not counted as done


def test_skip_nonfinite_drops_that_step_and_trains_on(report):
    skip = report["skip"]
    losses, sums = skip["losses"], skip["checksums"]
    i = NAN_STEP - 1
    assert math.isnan(losses[i]) and skip["skipped"] == 1
    assert all(math.isfinite(x) for j, x in enumerate(losses) if j != i)
    assert sums[i] == sums[i - 1], "a skipped step changed the parameters"
    assert sums[i + 1] != sums[i], "training stopped after the skipped step"
