"""Training from a teacher served by vLLM (``teachers[i].server``, `make teacher-server`).

One server for the session (the ``served_teacher`` fixture, started as the Makefile starts it)
and one process for every case (tests/e2e/served_teacher_cases.py). What is pinned:

- the per-step losses with the served teacher equal the in-process teacher's (same weights,
  fp32, same rows) within 1e-4 relative, for kd_topk and for xtoken with the chain term;
- a server that must not be used is refused by the preflight in one line: another model name,
  k above its max_logprobs, another tokenizer; gold and temperature != 1 by the config;
- a server killed mid-run stops the run with one line naming its URL.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO, identity_projection
from tokenbridge.alignment.text_shards import write_text_shards

pytestmark = pytest.mark.slow
REL = 1e-4


@pytest.fixture(scope="module")
def report(tmp_path_factory, served_teacher, student_dir) -> dict:
    from bench.common import shakespeare_docs

    url, model, teacher = served_teacher
    tmp = tmp_path_factory.mktemp("served_e2e")
    shards = write_text_shards(
        tmp / "shards", shakespeare_docs(8, chars=500), student_dir=student_dir,
        teacher_dirs=[student_dir],
    )  # fmt: skip
    projection = identity_projection(student_dir, tmp / "identity.safetensors")
    out = tmp / "report.json"
    args = [str(shards), teacher, str(projection), url, model, str(out)]
    cmd = [sys.executable, "-m", "tests.e2e.served_teacher_cases", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["kd_topk", "xtoken"])
def test_served_teacher_trains_as_the_live_teacher(report, mode):
    live, served = report[mode]["live"], report[mode]["served"]
    assert len(live) == len(served) == 3
    for a, b in zip(live, served):
        for key in ("loss", "kd/t", "ce"):
            assert b[key] == pytest.approx(a[key], rel=REL), (key, a[key], b[key])
    assert all(m["kd/t"] > 0.1 for m in served)  # a KD term of nats: the match means something


def test_servers_that_must_not_be_used_are_refused(report):
    r = report["refused"]
    assert r.pop("ok") is None
    expect = {
        "model": r"teachers\[0\]\.server: http://127\.0\.0\.1:\d+ serves \['tiny'\], not 'other'",
        "k": r"HTTP 400: .*logprobs of 16, which is greater than max allowed: 8.*K>=16",
        "tokenizer": r"tokenizes the probe text otherwise than gemma-3-270m",
        "gold": r"ConfigError: config teachers\[0\]\.server: loss gold reads more than a server",
        "temperature": r"ConfigError: config loss\.temperature: .* temperature 1, .* asks for 2\.0",
    }
    for case, pattern in expect.items():
        msg = r[case]
        assert msg is not None and "\n" not in msg, (case, msg)
        assert __import__("re").search(pattern, msg), (case, msg)


def test_a_killed_server_stops_the_run_naming_its_url(report, served_teacher):
    url = served_teacher[0]
    err = report["killed"]["error"]
    assert err is not None and err.startswith("TeacherServerError: "), err
    assert f"teacher server {url}/v1/completions: no answer for 5 s" in err and "\n" not in err
