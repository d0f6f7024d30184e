"""The align job at scale (issue 19): same windows as the per-document job with long documents,
bad rows, many rolled files and pieces; no GroupByKey over row data; a killed run publishes
nothing and a re-run completes; the default runner's worker processes share the work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.pipeline import PipelineVisitor
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline

from pipelines.align import align_dofns as F
from pipelines.align import job, readers, write_dofns
from pipelines.plumbing import rolling, writers
from tokenbridge import paths
from tokenbridge.alignment import WindowConfig, align, cut_windows, vocab_bytes
from tokenbridge.alignment.long_documents import PieceConfig
from tokenbridge.formats import shards

WINDOW = WindowConfig(max_student_tokens=64, max_teacher_tokens=56)


def _corpus(root, corpus_dir) -> dict[str, str]:
    """Files with long documents, short ones and bad rows -> {doc id: text} of the good ones."""
    root.mkdir()
    plays = sorted((corpus_dir / "shakespeare").glob("*.txt"))[:2]
    docs = {}
    for i, play in enumerate(plays):
        text = play.read_text()[: 30_000 + 7_000 * i]
        (root / f"play{i}.txt").write_text(text)
        docs[f"play{i}.txt"] = text
    verses = [json.loads(x) for x in (corpus_dir / "kjv.jsonl").read_text().splitlines()[:600]]
    lines = [json.dumps(v) for v in verses]
    lines[10] = '{"text": "broken'  # bad json
    lines[20] = json.dumps({"body": "no text field"})
    lines[30] = json.dumps({"text": ""})  # empty
    (root / "verses.jsonl").write_text("\n".join(lines) + "\n")
    for row, v in enumerate(verses):
        if row not in (10, 20, 30):
            docs[f"verses.jsonl:{row}"] = v["text"]
    (root / "bad.txt").write_bytes(b"caf\xe9 au lait")
    return docs


def _reference(docs: dict[str, str], t, s) -> list[dict]:
    rows = []
    for doc_id in sorted(docs):
        text = docs[doc_id]
        se, te = s.encode(text), t.encode(text)
        al = align(se, te, student_bytes=vocab_bytes(s), teacher_bytes=vocab_bytes(t))
        for w in cut_windows(text, student=(s, se), teachers=[(t, te, al)], config=WINDOW):
            row = shards.window_to_row(doc_id, w)
            rows.append({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in row.items()})
    return rows


def test_same_windows_as_the_per_document_job(tmp_path, pair_paths, pair_tokenizers, corpus_dir):
    docs = _corpus(tmp_path / "data", corpus_dir)
    t_path, s_path = pair_paths
    cfg = job.JobConfig(
        data=[f"{tmp_path}/data/*"],
        student=s_path,
        teachers=[t_path],
        out=tmp_path / "out",
        window=WINDOW,
        reader=readers.ReaderConfig(),
        pieces=PieceConfig(piece_chars=4096, overlap_chars=256),
        roll_bytes=64 << 10,  # tiny: many shard files
    )
    tasks, total, n_files = job.match_inputs(cfg.data, split_bytes=20_000)
    assert sum(t.path.endswith("verses.jsonl") for t in tasks) > 3  # byte ranges of one file
    rolling.prepare_out_dir(cfg.out, overwrite=False)
    p = BeamTestPipeline(runner="FnApiRunner")
    job.build_pipeline(p, cfg, tasks=tasks, total_bytes=total, input_files=n_files, run_id="t")
    p.run().wait_until_finish()

    ss = shards.open_shards(cfg.out)
    got = sorted(ss.table().to_pylist(), key=lambda r: (r["doc_id"], r["window"]))
    want = _reference(docs, *pair_tokenizers)
    assert [(r["doc_id"], r["window"]) for r in got] == [(r["doc_id"], r["window"]) for r in want]
    assert got == want  # seams included: these tokenizers are local within the overlap
    stats = ss.stats()
    assert len(ss.files) == stats["shards"] > 5
    assert stats["long_documents"] == 2 and stats["pieces"] > 10 and stats["seams_moved"] == 0
    assert stats["documents"] == len(docs) and stats["windows"] == len(want)
    assert stats["drops_by_reason"] == {
        "bad_json": 1,
        "missing_field": 1,
        "empty_document": 1,
        "undecodable_utf8": 1,
    }
    assert stats["tokens"]["student"] == sum(len(r["student_ids"]) for r in want)
    chunks = sum(r["teacher0_n_chunks"] for r in want)
    assert stats["chunks"] == [chunks]  # counted once although pieces overlap
    assert sorted(p.name for p in cfg.out.iterdir()) == sorted(
        [*(p.name for p in ss.files), "COMPLETED", "stats.json", "dead_letter.jsonl"]
    )  # the temporary directory is gone


class _Upstream(PipelineVisitor):
    """For every GroupByKey: the nearest DoFns of the package (or Impulse) feeding it."""

    OURS = (
        "pipelines.align.align_dofns",
        "pipelines.align.write_dofns",
        "pipelines.plumbing.writers",
    )

    def __init__(self):
        self.found: dict[str, set[str]] = {}

    def visit_transform(self, node):
        if isinstance(node.transform, beam.GroupByKey):
            self.found[node.full_label] = set().union(*map(self._sources, node.inputs))

    def _sources(self, pcoll) -> set[str]:
        node = pcoll.producer
        if node is None:  # the pipeline's start
            return {"Impulse"}
        while node.parts and node.outputs:  # a composite: find the leaf that made pcoll
            node = next(p for p in node.parts if pcoll in p.outputs.values())
        fn = getattr(node.transform, "fn", None)
        if fn is not None and type(fn).__module__ in self.OURS:
            return {type(fn).__name__}
        if isinstance(node.transform, beam.Impulse):
            return {"Impulse"}
        return set().union(*map(self._sources, node.inputs))


def _groupings(p) -> dict[str, set[str]]:
    v = _Upstream()
    p.visit(v)
    return v.found


def test_no_groupbykey_over_row_data(tmp_path, pair_paths):
    t, s = pair_paths
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "b.txt").write_text("more text")  # two read tasks: Create spreads them
    cfg = job.JobConfig(
        [f"{tmp_path}/*.txt"], s, [t], WINDOW, readers.ReaderConfig(), out=tmp_path / "o"
    )
    tasks, total, n = job.match_inputs(cfg.data)
    p = beam.Pipeline(runner="FnApiRunner")
    job.build_pipeline(p, cfg, tasks=tasks, total_bytes=total, input_files=n, run_id="x")
    found = _groupings(p)
    assert len(found) == 2  # Create's spread of the read tasks, and the final summary
    allowed = {
        "Impulse",
        write_dofns.WriteShardsDoFn.__name__,
        writers.WriteDeadLettersDoFn.__name__,
    }
    for label, sources in found.items():
        assert sources <= allowed, (label, sources)
    # the check sees a grouping over rows where there is one
    p2 = beam.Pipeline(runner="FnApiRunner")
    outs = job.build_pipeline(p2, cfg, tasks=tasks, total_bytes=total, input_files=n, run_id="y")
    _ = outs["dead_letters"] | beam.Map(lambda r: (r["file"], r)) | "BadGroup" >> beam.GroupByKey()
    assert any(F.ReadSplitDoFn.__name__ in v for v in _groupings(p2).values())


def _cli(data: str, out, teacher: str, student: str, *extra) -> list[str]:
    argv = ["--data", data, "--teacher", teacher, "--student", student, "--out", str(out)]
    return argv + ["--max-student-tokens", "64", "--max-teacher-tokens", "64", *extra]


def test_killed_run_publishes_nothing_and_a_rerun_completes(
    tmp_path, vocab_fixture, pair_paths, corpus_dir
):
    """Two worker processes (the default runner on a 2-core machine, asked for explicitly):
    both take part (each writes its own progress file), a SIGKILL mid-run leaves no COMPLETED
    and no shard file, a plain re-run completes with every document."""
    teacher, student = str(vocab_fixture("phi-3")), pair_paths[1]  # phi-3 loads fast
    data = tmp_path / "data"
    data.mkdir()
    verses = (corpus_dir / "kjv.jsonl").read_text().splitlines()[:3000]
    for i in range(10):
        (data / f"kjv{i}.jsonl").write_text("\n".join(verses) + "\n")
    out = tmp_path / "out"
    argv = _cli(f"{data}/*.jsonl", out, teacher, student, "--shard-mb", "0.05")
    argv += ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
    code = f"from pipelines.align import job; job.main({argv!r})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=paths.REPO_ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids, manifests = set(), []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            tmp = list(out.glob(f"{rolling.TMP_PREFIX}*"))
            if tmp:
                pids = {p.name.split("-")[0] for p in (tmp[0] / "progress").glob("*.json")}
                manifests = list(tmp[0].glob(f"*{rolling.MANIFEST_SUFFIX}"))
            if len(pids) >= 2 and manifests:
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(pids) == 2 and manifests, "both workers should have written before the kill"
    assert not (out / "COMPLETED").exists()
    assert list(out.glob("shard-*")) == []  # parts stay hidden until the finalize step
    with pytest.raises(shards.IncompleteShardsError):
        shards.open_shards(out)
    stats = job.run(argv)  # no --overwrite needed: the killed run never completed
    ss = shards.open_shards(out)
    assert stats["documents"] == 30_000 and stats["dead_letters"] == 0
    assert ss.num_rows == stats["windows"] > 30_000
    assert len({r for r in ss.table().column("doc_id").to_pylist()}) == 30_000
    assert not list(out.glob(f"{rolling.TMP_PREFIX}*"))  # the killed run's debris is gone
