"""Training from a teacher served by vLLM (``teachers[i].server``, `make teacher-server`).

One server for the session (the ``served_teacher`` fixture, started as the Makefile starts it)
and one process for every case (tests/e2e/served_teacher_cases.py). What is pinned:

- a server that must not be used is refused in one line before any model is built: another
  model name, k above its max_logprobs, another tokenizer (preflight); gold and temperature != 1
  (config);
- the per-step losses with served teachers equal the in-process teachers' (same weights, fp32,
  same rows) within 1e-4 relative, for kd_topk, xtoken and alm terms in one run;
- on-policy, the per-step losses with served teachers equal the in-process teachers' within
  1e-4 relative: rollouts sampled alike, scored by the server in opd_pg, xtoken and alm, with
  policy lag 1 (the server scores the next rollouts while the student learns); and for a
  student with another tokenizer (Gemma's), whose rollouts are re-tokenized and aligned for the
  served teacher on the fly (opd_pg, alm);
- the server killed (SIGKILL) mid-run: the run stops with exit 1 and one line naming the URL,
  its last checkpoint verifies, and once the server is back the resumed run repeats the
  uninterrupted served run's losses within 1e-5.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.helpers import identity_projection
from tests.e2e.served_teacher_cases import FAULT_TIMEOUT_S
from tokenbridge.alignment.text_shards import write_text_shards

pytestmark = pytest.mark.slow
REL = 1e-4  # served vs live: another engine's kernels
RESUME_REL = 1e-5  # served vs served, across a kill and a resume
TERMS = ("kd/t0", "kd/t1", "kd/t2")  # kd_topk, xtoken, alm


@pytest.fixture(scope="module")
def report(zygote, tmp_path_factory, served_teacher, student_dir, teacher_dir) -> dict:
    from bench.common import shakespeare_docs

    url, model, teacher, port = served_teacher
    tmp = tmp_path_factory.mktemp("served_e2e")
    shards = write_text_shards(
        tmp / "shards", shakespeare_docs(8, chars=500), student_dir=student_dir,
        teacher_dirs=[student_dir] * 3,
    )  # fmt: skip
    # a student with Gemma's tokenizer, two teachers with the served teacher's (SmolLM2's)
    cross = write_text_shards(
        tmp / "cross", shakespeare_docs(8, chars=500), student_dir=teacher_dir,
        teacher_dirs=[student_dir] * 2,
    )  # fmt: skip
    projection = identity_projection(student_dir, tmp / "identity.safetensors")
    out = tmp / "report.json"
    args = [str(shards), teacher, str(projection), url, model, str(port), str(out), str(cross)]
    proc = zygote.run(["-m", "tests.e2e.served_teacher_cases", *args], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_servers_that_must_not_be_used_are_refused_before_any_model_is_built(report):
    r = report["refused"]
    assert r.pop("ok") == {"stage": None, "error": None}
    expect = {
        "model": ("preflight", r"teachers\[0\]\.server: http://127\.0\.0\.1:\d+ serves \['tiny'\], "
                  r"not 'other'"),
        "k": ("preflight", r"HTTP 400: .*logprobs of 65, which is greater than max allowed: 64.*"
              r"K>=65"),
        "tokenizer": ("preflight", r"tokenizes the probe text otherwise than gemma-3-270m"),
        "gold": ("config", r"ConfigError: config teachers\[0\]\.server: loss gold reads more"),
        "temperature": ("config", r"ConfigError: config loss\.temperature: .* temperature 1, .* "
                        r"asks for 2\.0"),
    }  # fmt: skip
    assert set(r) == set(expect)
    for case, (stage, pattern) in expect.items():
        got = r[case]
        assert got["stage"] == stage, (case, got)
        assert got["error"] and "\n" not in got["error"], (case, got)
        assert re.search(pattern, got["error"]), (case, got)


def test_served_teachers_train_as_the_live_teachers(report):
    live, served = report["live"], report["served"]
    assert len(live) == len(served) == 3
    for a, b in zip(live, served):
        for key in ("loss", "ce", *TERMS):
            assert b[key] == pytest.approx(a[key], rel=REL), (key, a[key], b[key])
    # KD terms of nats and the student learning: the match means something. alm's binarised
    # KL is small (both random models give the realised tokens tiny probabilities) but reads
    # exactly the realised-token log-probs, the server's shifted prompt entries
    assert all(m[t] > 0.1 for m in served for t in TERMS[:2])
    assert all(m[TERMS[2]] > 1e-6 for m in served)
    assert served[-1]["loss"] < served[0]["loss"]


ON_TERMS = ("kd/t0", "kd/t1", "kd/t2")  # opd_pg, xtoken, alm on the student's rollouts


def test_served_teachers_score_rollouts_as_the_live_teachers(report):
    live, served = report["onpolicy"]["live"], report["onpolicy"]["served"]
    assert len(live) == len(served) == 3
    for a, b in zip(live, served):
        assert b["onpolicy"] == 1.0 and b["rollout/count"] == a["rollout/count"] == 4
        # the same rollouts: the same weights sampled them with the same seeds
        assert b["rollout/len_mean"] == a["rollout/len_mean"] > 0
        for key in ("loss", *ON_TERMS):
            assert b[key] == pytest.approx(a[key], rel=REL), (key, a[key], b[key])
        for t in ON_TERMS:  # every term read the completions: none silently empty
            assert b[f"coverage/{t[3:]}"] > 0
    # nats of KD on the completions (opd_pg's advantage is signed), and the student moved
    assert all(abs(m[t]) > 1e-3 for m in served for t in ON_TERMS[:2])
    assert served[-1]["loss"] != served[0]["loss"]


def test_served_teachers_score_realigned_rollouts_as_the_live_teachers(report):
    live, served = report["onpolicy"]["cross_live"], report["onpolicy"]["cross_served"]
    assert len(live) == len(served) == 3
    for a, b in zip(live, served):
        for t in ("t0", "t1"):  # the same rollouts, taken or dropped alike by the realignment
            for key in (f"coverage/{t}", f"dropped/{t}", f"chunks_invalid/{t}"):
                assert b[key] == a[key], (key, a[key], b[key])
            assert b[f"coverage/{t}"] > 0
        for key in ("loss", "kd/t0", "kd/t1"):
            assert b[key] == pytest.approx(a[key], rel=REL), (key, a[key], b[key])
    assert all(abs(m["kd/t0"]) > 1e-3 for m in served)


def test_a_killed_server_stops_the_run_and_the_resumed_run_repeats_its_losses(
    report, served_teacher
):
    url, f = served_teacher[0], report["fault"]
    lines = [x for x in f["stderr"].splitlines() if x.startswith("tokenbridge train:")]
    assert f["code"] == 1 and len(lines) == 1, f["stderr"][-2000:]
    assert re.match(
        rf"tokenbridge train: TeacherServerError: teacher server {re.escape(url)}/v1/completions: "
        rf"no answer for {FAULT_TIMEOUT_S:.0f} s .*restart the server", lines[0],
    ), lines[0]  # fmt: skip
    # stopped mid-run after its first checkpoint; the last one verifies and is resumed from
    at = f["resumed_at"]
    assert 1 <= at < 3 and f["checkpoints"][-1] == at and f["last_verifies"] is None, f
    assert [m["step"] for m in f["before"]] == list(range(1, at + 1))
    losses = [*f["before"], *f["after"]]
    assert len(losses) == 3
    for a, b in zip(report["served"], losses):
        for key in ("loss", "ce", *TERMS):
            assert b[key] == pytest.approx(a[key], rel=RESUME_REL), (key, a[key], b[key])
