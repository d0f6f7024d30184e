"""On-policy steps give the same losses in one process and on 2 gloo ranks (dp=2, tp=2; the tp=2
run with its rollouts packed for the student's forward, data.packing).

Sampling is seeded per rollout (run seed, prompt, draw, sample), so a prompt gets the same
completion in any layout; with file-order prompts (no shuffle) one process with 4 prompts a step
sees the same global set as two data-parallel ranks with 2 each, and as two tensor-parallel
ranks that share one prompt stream (each step's tokens broadcast from the first TP rank). The
loss is a global mean (local sums over the all-reduced count), so it must not depend on the
layout; the teachers' bits/byte of the student's completions neither.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import shakespeare_docs
from tests.e2e.helpers import REPO
from tokenbridge.alignment.text_shards import write_text_shards

COMMON = [
    "conf=onpolicy_debug",
    "device=cpu",
    "logging.progress=false",
    "logging.report=false",
    "parallel.threads=1",
    "parallel.teacher_placement=inprocess",
    "data.shuffle_buffer=0",
    "steps=3",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
    "checkpoint.export_at_end=false",
    "eval.max_texts=2",
    "onpolicy.eval_prompts=2",
    "onpolicy.micro_batch_size=2",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, teacher_dir, student_dir) -> Path:
    tmp = tmp_path_factory.mktemp("onpolicy_dist")
    return write_text_shards(tmp / "shards", shakespeare_docs(16, chars=600),
                             student_dir=student_dir, teacher_dirs=[teacher_dir, student_dir],
                             max_tokens=64)  # fmt: skip


def _losses(
    zygote, shards: Path, run_dir: Path, nproc: int, *extra: str
) -> tuple[list[float], dict, list[dict]]:
    args = [*COMMON, f"data.shards={shards}", f"run_dir={run_dir}", *extra]
    proc = zygote.run([str(REPO / "trainer" / "main.py"), *args], nproc=nproc, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    bpb = json.loads((run_dir / "bpb.json").read_text())
    return [r["loss"] for r in train], bpb, train


@pytest.fixture(scope="module")
def single(zygote, shards, tmp_path_factory):
    return _losses(
        zygote, shards, tmp_path_factory.mktemp("one") / "run", 1, "onpolicy.prompts_per_step=4"
    )


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.dp_shard=2", "onpolicy.prompts_per_step=2"),
        (
            "parallel.tp=2",
            "parallel.dp_shard=1",
            "onpolicy.prompts_per_step=4",
            "data.packing=true",
        ),
    ],
    ids=["dp2", "tp2_packed"],
)
def test_two_ranks_give_the_losses_of_one_process(zygote, shards, single, tmp_path, layout):
    want, want_bpb, want_records = single
    got, got_bpb, records = _losses(zygote, shards, tmp_path / "run", 2, *layout)
    assert len(got) == 3 and got[0] != got[1]
    assert got == pytest.approx(want, rel=1e-5)
    if "data.packing=true" in layout:  # a microbatch's rollouts share rows: no more padding
        for m, w in zip(records, want_records):
            assert 0 <= m["padding_fraction"] <= w["padding_fraction"] < 1
            assert m["tokens"] == w["tokens"]
    for when in ("before", "after"):
        key = f"teacher_on_student_{when}"
        assert got_bpb[key] == pytest.approx(want_bpb[key], rel=1e-5)
