"""End to end on conf/experiment/debug: 2 gloo ranks, a teacher worker per rank.

Tiny random-init student (SmolLM2 tokenizer) and teacher (Gemma 3 tokenizer) on real aligned
shards of the shipped corpus and the real projection, xtoken loss through the shared-memory
channel. Launches: a full run (loss falls, channel memory constant, eval, export, the run
report; the export holds the final checkpoint's weights bit for bit and scores the run's own
after bits per byte through the eval code), a run resumed from the full run's mid-way checkpoint
with activation checkpointing on (same losses, same exported weights), a run whose teacher
workers form their own tensor-parallel group and one of them is killed (under `trainer.launch`:
one line from the rank that lost its worker, exit 1, no orphan, no /dev/shm segment, nothing from
torchrun or Python's resource tracker), a run with mismatched shards (refused before anything is
built, in one line), and the integrity cases of issue 20: a copy of the full run whose newest
checkpoint is truncated (refused with checkpoint.strict=true; else resumed from the older one,
same losses) and a copy of the shards with 32 bytes changed (refused in one line, exit 2); and
of issue 28: a planted pickle in a checkpoint (refused in one line, exit 2, never run); and of
issue 39: one step traced call by call in one process (`tests.e2e.step_trace`), entering each
trainer/ file once. The runs that are not about the launcher are forked from the session's
`zygote` (torchrun's environment for 2 ranks, without its ~10 s of imports per process); the
killed worker and the planted pickle on 2 ranks go through `trainer.launch` (their ranks
forked from the zygote through its shim, `tests.zygote_shim`).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed.checkpoint as dcp

from bench.common import PROJECTION, ensure_projection, run_trainer, shakespeare_docs
from tests.e2e import procs
from tests.e2e.helpers import REPO
from tests.unit.test_checkpoint_safety import Payload, rewrite_marker
from tests.unit.test_report import check_numbers, check_page
from tests.zygote import REAL_SPAWN, SHIM
from tokenbridge import flops, models
from tokenbridge.alignment.text_shards import write_text_shards
from tokenbridge.formats import checksums
from tokenbridge.formats.shards import open_shards
from tokenbridge.tokenizers import load_tokenizer
from trainer.checkpoint import dcp_io
from trainer.config.sections import DataConfig
from trainer.data.shard_reader import ShardReader
from trainer.eval.bpb import evaluate_bpb
from trainer.eval.runner import load_model
from trainer.report import write_report

MAIN = str(REPO / "trainer" / "main.py")  # one-process runs: forked from `zygote` (tests.zygote)
COMMON = ["logging.progress=false", "parallel.threads=1", "optim.warmup_steps=1"]
PEAK_TFLOPS = 2.0  # the full run's logging.peak_tflops
# the CPU runs name their device: `auto` would put two ranks on a one-GPU machine's GPU
CPU = [*COMMON, "device=cpu"]
# runs whose subject is not the teacher worker (the full run and the killed worker are): the
# teacher in the rank's process computes what the worker does, without a process to start
INPROCESS = "parallel.teacher_placement=inprocess"


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, teacher_dir, student_dir) -> dict:
    """Debug shards + the real projection (the `make projection` file, built once if missing)."""
    tmp = tmp_path_factory.mktemp("e2e")
    ensure_projection(teacher_dir, student_dir)
    docs = shakespeare_docs(24, chars=700)
    shards = write_text_shards(
        tmp / "shards", docs, student_dir=student_dir, teacher_dirs=[teacher_dir], max_tokens=64
    )
    # same student, but the teacher column made with the student's tokenizer: must be refused
    wrong = write_text_shards(
        tmp / "wrong", docs[:2], student_dir=student_dir, teacher_dirs=[student_dir], max_tokens=64
    )
    return {"tmp": tmp, "shards": shards, "wrong": wrong}


@pytest.fixture(scope="module")
def full_run(zygote, inputs) -> Path:
    run_dir = inputs["tmp"] / "full"
    # a CPU has no peak in the table: the command line names one, so MFU is computed
    args = ["conf=debug", f"data.shards={inputs['shards']}", f"run_dir={run_dir}", "steps=8",
            "checkpoint.interval=4", "eval.max_texts=4", f"teachers.0.projection={PROJECTION}",
            f"logging.peak_tflops={PEAK_TFLOPS}"]  # fmt: skip
    # its teacher workers spawned as a user's are (fresh interpreters), not forked for the tests
    proc = zygote.run([MAIN, *args, *CPU], nproc=2, env={REAL_SPAWN: "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "held-out bits/byte  student after" in proc.stdout
    assert "precision:            cpu: student float32 (master float32, reduce float32), " \
        "fused AdamW yes; teachers gemma3-tiny float32" in proc.stdout  # fmt: skip
    assert re.search(r"throughput \(median\):  [\d.]+ student tokens/s per device, .*MFU",
                     proc.stdout)  # fmt: skip
    assert f"run report:           {run_dir / 'report' / 'report.html'}" in proc.stdout
    return run_dir


def test_full_run_learns_and_reuses_channel_memory(full_run):
    train = records(full_run)
    assert [r["step"] for r in train] == list(range(1, 9))
    losses = [r["loss"] for r in train]
    assert losses[-1] < losses[0] - 0.3, losses
    for r in train:  # the xtoken term is computed and reported on its own, with its coverage
        assert r["kd/gemma3-tiny"] > 0 and 0 < r["coverage/gemma3-tiny"] <= 1
        assert r["ce"] > 0 and r["tokens"] > 0
    # one ring per rank, allocated once: same segment and size at every step
    assert {(r["shm_segments"], r["shm_bytes"]) for r in train} == {(1, train[0]["shm_bytes"])}
    assert train[0]["shm_bytes"] > 0
    # per device: 2 ranks share the global rate; the student's training FLOPs per token lie
    # between the formula's at the shortest and the longest padded row (8 and 64 positions)
    student = json.loads((full_run / "export" / "config.json").read_text())
    low, high = (flops.flops_per_token(student, seq=n) for n in (8, 64))
    for r in train:
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2, rel=1e-9)
        per_token = r["tflops_per_device"] * 1e12 / r["tokens_per_s_per_device"]
        assert low * (1 - 1e-9) <= per_token <= high * (1 + 1e-9), (low, per_token, high)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / PEAK_TFLOPS, rel=1e-9)
        assert r["teacher_tflops_per_device"] > 0 and r["teacher_mfu"] > 0  # the live teacher
        assert r["memory_gib"] > 0
    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["precision"] == {
        "device": "cpu", "param_dtype": "float32", "reduce_dtype": "float32",
        "master_dtype": "float32", "teacher_dtypes": {"gemma3-tiny": "float32"},
        "fused_optimizer": True}  # fmt: skip
    assert summary["throughput"]["peak_tflops"] == PEAK_TFLOPS
    assert summary["throughput"]["mfu"] == pytest.approx(
        statistics.median(r["mfu"] for r in train), rel=1e-9)  # fmt: skip
    bpb = summary["bpb"]
    assert bpb["student_after"] < bpb["student_before"]
    assert bpb["teachers"]["gemma3-tiny"] > 0
    assert list((full_run / "tensorboard").iterdir())


def test_run_report_shows_the_run_and_one_killed_early(full_run, tmp_path):
    """The report the trainer wrote at the end, and one of this run beside a copy of it killed
    after two steps (no summary, no bpb.json, a cut last line), on the same axes."""
    html = full_run / "report" / "report.html"
    check_page(html)
    pngs = {p.stem for p in html.parent.glob("*.png")}
    assert {"loss", "ce", "kd", "bpb", "lr", "grad_norm", "tokens_per_s", "coverage",
            "chunk_kinds", "step_time", "tokens_per_s_per_device", "mfu"} <= pngs  # fmt: skip
    assert "<h2>Precision and throughput</h2>" in html.read_text()
    assert check_numbers(html.parent / "report.json", {"full": full_run}) >= 10
    killed = tmp_path / "killed"
    killed.mkdir()
    head = (full_run / "metrics.jsonl").read_text().splitlines(keepends=True)[:4]
    (killed / "metrics.jsonl").write_text("".join(head) + head[-1][:20])
    both = write_report([full_run, killed], out=tmp_path / "both")
    check_page(both)
    data = json.loads((both.parent / "report.json").read_text())
    assert [x["label"] for x in data["panels"]["loss"]["lines"]] == ["full", "killed"]
    assert check_numbers(both.parent / "report.json", {"full": full_run, "killed": killed}) >= 20
    assert "killed: no summary.json" in both.read_text()


def test_export_is_a_plain_hf_directory(full_run):
    from transformers import AutoModelForCausalLM

    export = full_run / "export"
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    # every weight of the config read from the file, none left at its random init, none dropped
    assert {k: list(v) for k, v in info.items()} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []
    }  # fmt: skip
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.hidden_size == 64 and model.config.vocab_size == 49152
    assert (
        load_tokenizer(export).fingerprint
        == load_tokenizer(REPO / "artifacts" / "models" / "smollm2-135m").fingerprint
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist
def test_export_holds_the_trained_weights(full_run):
    """Every tensor of the export, loaded as the eval loads it, equals bit for bit the student's
    in the run's final checkpoint (step 8, saved after the last step; the export follows it and
    the after-eval, which changes no weight), under the same names: none missing, none extra."""
    summary = json.loads((full_run / "summary.json").read_text())
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == "step-00000008"
    index = dcp_io.read_index(ckpt)  # the checkpoint's JSON index, read as the trainer does
    meta = index.state_dict_metadata
    prefix = "app/model/"  # ModelOptimState's model state, keyed by path (state_split)
    trained = {k[len(prefix) :]: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in meta.items() if k.startswith(prefix)}  # fmt: skip
    dcp.load({prefix + k: v for k, v in trained.items()}, storage_reader=dcp_io.SafeReader(ckpt, index),
             planner=dcp_io.SafePlanner(), no_dist=True)  # fmt: skip
    exported = models.load_pretrained(full_run / "export").state_dict()
    assert sorted(exported) == sorted(trained) and len(trained) == 21
    differ = [k for k in trained if not torch.equal(exported[k], trained[k])]
    assert not differ, differ
    # tied: lm_head is the embedding in the checkpoint (one tensor saved once in the export)
    assert torch.equal(trained["lm_head.weight"], trained["model.embed_tokens.weight"])


def test_export_scores_the_runs_own_after_bits_per_byte(inputs, full_run):
    """The export, loaded and scored by the eval code (`trainer.eval.runner.load_model`, as the
    science table's OOD and suite columns are; `evaluate_bpb`) on the run's own held-out texts,
    gives the run's after bits per byte. Those texts are rebuilt as the trainer picks them (its
    reader's split, the first ``eval.max_texts=4``); their count and bytes are summary.json's.

    Tolerance 1e-6 bits/byte: the weights are identical (above) and the texts the same, so only
    float summation order may differ (the run scores under FSDP on 2 ranks, batched by 4); seen
    here: 0.0 with the same batching, 5e-9 scoring one text at a time. What it tells apart
    (measured on this run): the step-4 checkpoint's weights are off by 0.15, the untrained
    student by 0.43, a re-initialised final norm by 3e-3 or MLP matrix by 8e-4; a re-initialised
    attention projection moves it by less than 1e-6 (attention barely matters in this tiny
    model), which is why the test above compares the tensors themselves."""
    summary = json.loads((full_run / "summary.json").read_text())
    data = DataConfig(shards=str(inputs["shards"]))  # the debug run keeps the split's defaults
    reader = ShardReader(open_shards(inputs["shards"]), max_student_tokens=512)
    _, held = reader.split(data.eval_fraction, by=data.eval_split)
    texts = [reader.text(int(i)) for i in held[:4]]
    assert len(texts) == summary["eval_texts"] == 4
    assert sum(len(t.encode("utf-8")) for t in texts) == summary["eval_bytes"]
    model, tokenizer, _ = load_model(full_run / "export", device="cpu", dtype="float32")
    got = evaluate_bpb(model, tokenizer, texts, batch_size=4)["bpb"]
    after = summary["bpb"]["student_after"]
    assert after == json.loads((full_run / "bpb.json").read_text())["student_after"]
    print(f"export bpb {got:.9f} vs the run's after {after:.9f}: {got - after:+.2e}")
    assert got == pytest.approx(after, rel=0, abs=1e-6)
    assert abs(got - summary["bpb"]["student_before"]) > 0.1  # not the untrained student


def test_resume_from_checkpoint_repeats_the_uninterrupted_losses(
    zygote, inputs, full_run, s3_server
):
    """Resumed with activation checkpointing on (the full run had none): the checkpoint's
    plain HF names load into the wrapped blocks, recomputing the activations changes no loss,
    and the export at the end holds the uninterrupted run's weights under the same names.
    Entirely against the test S3 server: its shards are streamed (``data.stream``: one file
    at a time into the node's cache, fetched once for both ranks under each file's lock), its
    projection fetched once (by local rank 0; rank 1 waits), each verified; its
    checkpoints live in the store (checkpoint.dir), where it finds the full run's step 4 on its
    own (resume=auto: fetched and verified), and saves step 8 through DCP's fsspec writer."""
    ckpt = full_run / "checkpoints" / "step-00000004"
    assert (ckpt / ".metadata").is_file()
    run_dir = inputs["tmp"] / "resumed"
    bucket = s3_server.new_bucket()
    shards_url = s3_server.upload(inputs["shards"], bucket, "shards")
    projection_url = s3_server.upload(PROJECTION, bucket, f"projection/{PROJECTION.name}")
    s3_server.upload(ckpt, bucket, f"ckpt/{ckpt.name}")
    args = ["conf=debug", f"data.shards={shards_url}", f"run_dir={run_dir}", "steps=8",
            f"checkpoint.dir=s3://{bucket}/ckpt", "eval.max_texts=0",
            f"data.cache_dir={run_dir}-cache", "parallel.activation_checkpointing=full",
            "data.stream=true", "data.stream_files=2", INPROCESS, "logging.report=false",
            f"teachers.0.projection={projection_url}"]  # fmt: skip
    proc = zygote.run([MAIN, *args, *CPU], nproc=2, env=s3_server.env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"data.shards={shards_url}: reading its copy {run_dir}-cache/shards-" in proc.stderr
    assert "-stream (streamed)" in proc.stderr
    assert f"teachers[0].projection={projection_url}: reading its copy" in proc.stderr
    entries = [p for p in Path(f"{run_dir}-cache").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 3  # the streamed shards, the projection, step 4
    # logging.report=false: no report at the end, and the summary names none
    assert not (run_dir / "report").exists() and "run report:" not in proc.stdout
    saved = s3_server.download(bucket, "ckpt/step-00000008", run_dir / "step-00000008")
    assert [r for r in checksums.verify_dir(saved) if not r.ok] == []  # marker: every file
    assert sorted(json.loads((saved / "COMPLETED").read_text())["checksums"]) == sorted(
        p.name for p in saved.iterdir() if p.name != "COMPLETED"
    )
    dcp_io.read_index(saved)  # the JSON index, as the local writer writes it
    resumed = {r["step"]: r["loss"] for r in records(run_dir)}
    full = {r["step"]: r["loss"] for r in records(full_run)}
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], rel=1e-6, abs=1e-6), step
    got = models.load_pretrained(run_dir / "export").state_dict()
    want = models.load_pretrained(full_run / "export").state_dict()
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_one_debug_step_enters_each_trainer_file_once(zygote, inputs):
    """One logging step of conf=debug traced call by call (`tests.e2e.step_trace`): on every
    call stack the trainer/ files form contiguous runs, so a reader following the step from the
    loop to the losses enters each file once (no source reaches back into the `Trainer`)."""
    out = inputs["tmp"] / "step_trace.json"
    cmd = ["-m", "tests.e2e.step_trace", str(inputs["shards"]), str(PROJECTION),
           str(inputs["tmp"] / "step_trace"), str(out), *CPU]  # fmt: skip
    proc = zygote.run(cmd)
    assert proc.returncode == 0, proc.stderr[-6000:]
    found = json.loads(out.read_text())
    assert found["broken"] == [], "\n".join(found["broken"])
    # the trace saw the step: the loop, the step, the source, the feed, the forward, the losses
    step = {"loop.py", "step.py", "data/shard_source.py", "teacher/dispatch.py", "parallel/head.py",
            "loss_terms.py"}  # fmt: skip
    assert step <= set(found["entered"]), found["entered"]


def test_killed_teacher_worker_fails_the_run_cleanly(zygote, inputs):
    run_dir = inputs["tmp"] / "killed"
    # the ranks forked from the zygote through its shim: torchrun's agent is real
    cmd = [sys.executable, "-m", "trainer.launch", "--standalone", "--nproc_per_node=2",
           str(SHIM), MAIN, "conf=debug", f"data.shards={inputs['shards']}",
           f"run_dir={run_dir}", "steps=1000", "eval.max_texts=0", "checkpoint.save_at_end=false",
           "teachers.0.tp=2",  # the two workers form their own process group (teacher TP)
           f"teachers.0.projection={PROJECTION}", *CPU]  # fmt: skip
    # the workers spawned for real: the test is about how a worker's death reaches the ranks
    # (a forked worker behind its stand-in dies a moment after it, which let the peer rank's
    # line come first in 1 run of 5)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **zygote.shim_env(), REAL_SPAWN: "1"}  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not any(r["step"] >= 2 for r in records(run_dir)):
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.5)
        family = procs.descendants(proc.pid)
        for rank in zygote.ranks_of(family):  # each rank and its teacher worker
            family += [rank, *procs.descendants(rank)]
        workers = [p for p in family if "multiprocessing.spawn" in procs.cmdline(p)]
        assert len(workers) == 2, [procs.cmdline(p) for p in family]
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # one line, from the rank whose worker died; its peer, cut off, says nothing
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err[-6000:]
    assert re.match(
        rf"tokenbridge train \[rank [01]/2\]: TeacherWorkerError: teacher worker \(pid "
        rf"{workers[0]}\) was killed by signal SIGKILL while \w+ microbatch \d+; ",
        lines[0],
    ), lines
    name = "tokenbridge_"

    def left() -> tuple[list[int], list[str]]:
        return [p for p in family if procs.alive(p)], [f for f in os.listdir("/dev/shm") if
                f.startswith(name) and any(f.startswith(f"{name}{p}_") for p in family)]  # fmt: skip

    deadline = time.monotonic() + 1.0  # polled: the same second at most, not always
    while any(left()) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive, segments = left()
    assert not alive, "orphaned processes"
    assert not segments


def test_mismatched_shards_are_refused_before_anything_loads(zygote, inputs):
    run_dir = inputs["tmp"] / "refused"
    args = ["conf=debug", f"data.shards={inputs['wrong']}", f"run_dir={run_dir}",
            f"teachers.0.projection={PROJECTION}"]  # fmt: skip
    proc = zygote.run([MAIN, *args])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-4000:]
    assert lines[0].startswith(f"tokenbridge train: FingerprintMismatchError: {inputs['wrong']}")
    assert "teacher 0 tokenizer" in lines[0] and "re-run the align job" in lines[0]
    assert not run_dir.exists()  # the trainer was never built


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_debug_run_on_cuda_with_cuda_ipc_channel(inputs):
    """The same run on a GPU: NCCL, the channel's ring shared by CUDA IPC handles."""
    run_dir = inputs["tmp"] / "cuda"
    args = ["conf=debug", f"data.shards={inputs['shards']}", f"run_dir={run_dir}", "steps=4",
            "device=cuda", "eval.max_texts=2", f"teachers.0.projection={PROJECTION}"]  # fmt: skip
    proc = run_trainer(args + COMMON, nproc=1)
    assert proc.returncode == 0, proc.stderr[-6000:]
    train = records(run_dir)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(r["shm_segments"] == 0 for r in train)  # no host shared memory on the GPU path
    assert train[-1]["loss"] < train[0]["loss"]
    # auto on CUDA: bfloat16 compute over float32 masters, a bfloat16 teacher, fused AdamW;
    # MFU where the table knows this GPU; memory_gib is the CUDA allocator's peak
    p = json.loads((run_dir / "summary.json").read_text())["precision"]
    assert (p["param_dtype"], p["master_dtype"], p["fused_optimizer"]) == (
        "bfloat16",
        "float32",
        True,
    )
    assert p["teacher_dtypes"] == {"gemma3-tiny": "bfloat16"}
    known = flops.peak_flops(torch.cuda.get_device_name(), dtype="bfloat16") is not None
    for r in train:
        assert r["memory_gib"] > 0 and r["tflops_per_device"] > 0
        assert ("mfu" in r) == known and ("teacher_mfu" in r) == known


def _one_line(stderr: str, *needles: str) -> str:
    """`stderr` is one ``tokenbridge train:`` line (`tokenbridge.cli`) holding every needle."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenbridge train: "), stderr[-4000:]
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def test_damaged_newest_checkpoint_falls_back_to_the_older_one(zygote, inputs, full_run):
    """Issue 20: the newest checkpoint truncated. strict: refused before anything loads, exit 2;
    default: one line, moved aside, resumed at step 4 with the uninterrupted run's losses."""
    run_dir = inputs["tmp"] / "fallback"
    shutil.copytree(full_run / "checkpoints", run_dir / "checkpoints")
    newest = run_dir / "checkpoints" / "step-00000008"
    f = newest / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    args = ["conf=debug", f"data.shards={inputs['shards']}", f"run_dir={run_dir}", "steps=8",
            "eval.max_texts=0", "checkpoint.export_at_end=false", INPROCESS,
            "logging.report=false", f"teachers.0.projection={PROJECTION}"]  # fmt: skip
    proc = zygote.run([MAIN, *args, "checkpoint.strict=true", *CPU])
    assert proc.returncode == 2
    _one_line(proc.stderr, "DamagedCheckpointError", str(f), "expected xxh3_64", "strict=true")
    assert f.is_file()
    proc = zygote.run([MAIN, *args, *CPU], nproc=2)
    assert proc.returncode == 0, proc.stderr[-6000:]
    notes = [x for x in proc.stderr.splitlines() if "is damaged" in x]
    assert len(notes) == 1 and str(f) in notes[0], proc.stderr[-4000:]
    assert notes[0].startswith("tokenbridge train: checkpoint step-00000008 is damaged (")
    assert notes[0].endswith("moved aside to step-00000008.damaged; resuming from step-00000004")
    assert (run_dir / "checkpoints" / "step-00000008.damaged" / "__0_0.distcp").is_file()
    resumed = {r["step"]: r["loss"] for r in records(run_dir)}
    full = {r["step"]: r["loss"] for r in records(full_run)}
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], rel=1e-6, abs=1e-6), step


def test_a_planted_pickle_is_refused_in_one_line_and_never_runs(zygote, inputs, full_run, tmp_path):
    """Issue 28, item 3: a copy of the full run whose newest checkpoint holds a pickle that would
    create a file when unpickled, its checksum marker rewritten to match. In DCP's index:
    refused by preflight (one process); in a tensor record of rank 1's file: refused as the two
    ranks load it (`trainer.launch`). Both: one line naming the file, exit 2, no step, no
    older checkpoint tried, and the file never created."""
    ran = tmp_path / "payload-ran"
    payload = pickle.dumps(Payload(ran), protocol=2)
    for name, nproc in ((".metadata", 1), ("__1_0.distcp", 2)):
        run_dir = inputs["tmp"] / f"planted-{nproc}"
        shutil.copytree(full_run / "checkpoints", run_dir / "checkpoints")
        newest = run_dir / "checkpoints" / "step-00000008"
        f = newest / name
        data = bytearray(f.read_bytes() if nproc > 1 else b"")
        data[: len(payload)] = payload
        f.write_bytes(bytes(data))
        rewrite_marker(newest)
        args = [MAIN, "conf=debug", f"data.shards={inputs['shards']}", f"run_dir={run_dir}",
                "steps=10", "eval.max_texts=0", "checkpoint.save_at_end=false",
                f"teachers.0.projection={PROJECTION}", *CPU]  # fmt: skip
        if nproc == 1:
            proc = zygote.run(args, timeout=300)
        else:
            # the ranks forked from the zygote through its shim: torchrun's agent is real
            cmd = [sys.executable, "-m", "trainer.launch", "--standalone",
                   f"--nproc_per_node={nproc}", str(SHIM), *args]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   **zygote.shim_env()}  # fmt: skip
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=300)  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-4000:]
        line = _one_line(proc.stderr, f"UnsafeCheckpointError: {f}", "is not read")
        assert ("is a pickle, not JSON" if nproc == 1 else "names io.open") in line
        assert not ran.exists() and not records(run_dir)
        assert newest.is_dir()  # refused, not moved aside as damaged


def test_changed_shard_bytes_are_refused_in_one_line(zygote, inputs):
    """Issue 20: 32 bytes changed inside a shard's data buffer (the first row's student_ids now
    2,147,483,642: it used to crash at the embedding, naming nothing). Default: refused by its
    checksum in preflight, nothing built. ``data.verify=never``: the run starts, and the value
    check stops it at the row's first read, before the model sees it. Both: one line, exit 2."""
    shards = inputs["tmp"] / "damaged-shards"
    shutil.copytree(inputs["shards"], shards)
    f = sorted(shards.glob("shard-*.arrow"))[0]
    with pa.memory_map(str(f)) as src:
        first = pa.ipc.open_file(src).read_all().column("student_ids")[0].values
        first = first.to_numpy()[:8].astype(np.int32).tobytes()
    data = bytearray(f.read_bytes())
    at = bytes(data).index(first)
    data[at : at + 32] = np.full(8, 2_147_483_642, np.int32).tobytes()
    f.write_bytes(bytes(data))
    run_dir = inputs["tmp"] / "damaged-run"
    args = ["conf=debug", f"data.shards={shards}", f"run_dir={run_dir}",
            f"teachers.0.projection={PROJECTION}"]  # fmt: skip
    proc = zygote.run([MAIN, *args])
    assert proc.returncode == 2
    _one_line(proc.stderr, "DamagedFileError", str(f), "expected xxh3_64", "found xxh3_64")
    assert not run_dir.exists()
    # unverified, in file order: the first row read is in the damaged record batch
    proc = zygote.run([MAIN, *args, "data.verify=never", "data.shuffle_buffer=0", "steps=2",
                       "eval.max_texts=0", *CPU])  # fmt: skip
    assert proc.returncode == 2
    _one_line(proc.stderr, "BadValueError", f"{f} row ", "column student_ids: value 2147483642")
    assert not records(run_dir)  # no step was taken
