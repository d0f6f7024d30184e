"""End to end on conf/experiment/onpolicy_debug: `trainer/main.py`, teacher workers, CPU.

A tiny SmolLM2-tokenizer student samples completions of shard-window prefixes; a tiny
Gemma-tokenizer teacher (on-the-fly alignment, opd_pg) and a tiny SmolLM2-tokenizer teacher
(top-k OPD on the student's support) score them in their worker processes. Launches: a full
run (metrics, the teachers' bits/byte of the student's completions before and after); the same
run stopped after its checkpoint and resumed (same losses); a run with policy lag 1, GKD
mixing (lmbda 0.5: on- and off-policy steps) and the sampler's int8 copy (ratio-weighted
steps), stopped and resumed likewise; an off-policy
baseline (lmbda 0) ended by its time budget; a teacher worker killed while it scores (the
clear error, in bounded time).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from bench.common import ensure_projection, shakespeare_docs
from tests.e2e.helpers import REPO
from tests.zygote import REAL_SPAWN
from tokenbridge.alignment.text_shards import write_text_shards

CPU = ["logging.progress=false", "parallel.threads=1", "device=cpu", "eval.max_texts=4"]


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, teacher_dir, student_dir) -> Path:
    ensure_projection(teacher_dir, student_dir)
    tmp = tmp_path_factory.mktemp("onpolicy")
    return write_text_shards(tmp / "shards", shakespeare_docs(24, chars=700),
                             student_dir=student_dir, teacher_dirs=[teacher_dir, student_dir],
                             max_tokens=64)  # fmt: skip


# resume runs: teachers in-process and no evals (the full run covers workers and evals)
LEAN = (
    "parallel.teacher_placement=inprocess",
    "eval.max_texts=0",
    "onpolicy.eval_prompts=0",
    "logging.report=false",
)


def _run(zygote, shards: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["conf=onpolicy_debug", f"data.shards={shards}", f"run_dir={run_dir}", *CPU, *extra]
    proc = zygote.run([str(REPO / "trainer" / "main.py"), *args], timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def full_run(zygote, shards, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("onpolicy_runs") / "full"
    proc = _run(zygote, shards, run_dir)
    assert "bits/byte of student completions after" in proc.stdout
    return run_dir


def test_on_policy_run_reports_rollouts_terms_and_teacher_bpb(full_run):
    train = records(full_run)
    assert [r["step"] for r in train] == list(range(1, 7))
    for r in train:
        assert r["onpolicy"] == 1.0
        # finite: neither NaN nor +-inf (x == approx(x), used before, holds for inf)
        assert math.isfinite(r["kd/gemma3-tiny"]), r
        assert r["kd/smollm2-tiny-teacher"] >= 0 and math.isfinite(r["kd/smollm2-tiny-teacher"])
        assert r["rollout/count"] == 4 and 0 < r["rollout/len_mean"] <= 16
        assert 0 <= r["rollout/stopped_frac"] <= 1 and r["rollout/gen_tokens_per_s"] > 0
        assert 0 < r["coverage/gemma3-tiny"] <= 1.0 + 1e-9
        assert r["coverage/smollm2-tiny-teacher"] == pytest.approx(1.0)
        for key in ("time/generate_s", "time/align_s", "time/teacher_wait_s", "time/student_s"):
            assert r[key] >= 0
        # one device: the per-device rate is the whole; no FLOPs (the step also sampled)
        assert r["tokens_per_s_per_device"] == r["tokens_per_s"] and "tflops_per_device" not in r
    summary = json.loads((full_run / "summary.json").read_text())
    want = {"gemma3-tiny": "float32", "smollm2-tiny-teacher": "float32"}  # auto on a CPU
    assert summary["precision"]["teacher_dtypes"] == want
    bpb = summary["bpb"]
    for when in ("before", "after"):
        got = bpb[f"teacher_on_student_{when}"]
        assert set(got) == {"gemma3-tiny", "smollm2-tiny-teacher"}
        assert all(v > 0 and math.isfinite(v) for v in got.values()), got
    losses = [r["loss"] for r in train]
    assert len(set(losses)) == len(losses) and all(r["grad_norm"] > 0 for r in train)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train)


def test_resume_across_on_policy_steps_is_exact(zygote, full_run, shards, tmp_path):
    run_dir, full = tmp_path / "resumed", tmp_path / "full"
    _run(zygote, shards, full, *LEAN)
    _run(zygote, shards, run_dir, *LEAN, "stop_after=3")  # as if killed after the step-3 checkpoint
    _run(zygote, shards, run_dir, *LEAN)
    want = [r["loss"] for r in records(full)][3:]
    # the in-process teachers compute what the workers do
    assert [r["loss"] for r in records(full)] == pytest.approx(
        [r["loss"] for r in records(full_run)], rel=1e-6
    )
    got = [r["loss"] for r in records(run_dir) if r["step"] > 3]
    assert got == pytest.approx(want, rel=1e-6)


def test_lag_one_and_lambda_mixing_resume_exactly(zygote, shards, tmp_path):
    # the sampler's int8 copy too: its recorded log-probs ride in the pending rollouts
    extra = ("onpolicy.lag=1", "onpolicy.lmbda=0.5", "onpolicy.sampler_weights=int8", *LEAN)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(zygote, shards, full, *extra)
    _run(zygote, shards, resumed, *extra, "stop_after=3")
    _run(zygote, shards, resumed, *extra)
    a = records(full)
    kinds = [r.get("onpolicy", 0.0) for r in a]
    assert 0 < sum(kinds) < len(kinds)  # both kinds of steps ran
    for r in (r for r in a if r.get("onpolicy")):  # ratio-weighted: weights near 1, capped
        assert 0 < r["ratio/weight_mean"] <= 2.0 and 0 <= r["ratio/clipped_frac"] <= 1
        assert 0 < r["ratio/abs_log_ratio_mean"] < 1.0
    b = [r for r in records(resumed) if r["step"] > 3]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a[3:]], rel=1e-6)


def test_an_off_policy_baseline_on_a_time_budget_reports_the_teachers_bpb(zygote, shards, tmp_path):
    """`bench/onpolicy/equal_budget.py`'s baselines: lmbda 0 (every step off-policy, the on-policy
    side only evaluates) ending on `time_budget_s`, then the after-evals as at `steps`."""
    run_dir = tmp_path / "baseline"
    _run(zygote, shards, run_dir, "onpolicy.lmbda=0", "steps=50", "time_budget_s=1e-9",
         "parallel.teacher_placement=inprocess", "onpolicy.eval_prompts=2",
         "checkpoint.interval=0", "checkpoint.export_at_end=false", "logging.report=false")  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["out_of_time"] is True
    assert all("onpolicy" not in r for r in records(run_dir))
    bpb = summary["bpb"]
    assert bpb["student_after"] > 0
    assert set(bpb["teacher_on_student_after"]) == {"gemma3-tiny", "smollm2-tiny-teacher"}


def test_teacher_worker_dying_while_scoring_is_a_clear_error(zygote, shards, tmp_path):
    """The worker is killed with microbatches in flight: the step raises TeacherWorkerError
    naming the worker and its signal, within bounded time (its liveness is polled)."""
    script = REPO / "tests" / "e2e" / "onpolicy_kill.py"
    # real workers (spawned, not forked behind a stand-in): their death is what is under test
    proc = zygote.run([str(script), str(shards), str(tmp_path / "run")], timeout=600,
                      env={REAL_SPAWN: "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"] == "TeacherWorkerError"
    assert "killed by signal SIGKILL" in got["message"]
    assert got["seconds"] < 10
