"""A worker of the threads runner left alone at the end of a run encodes its teachers on a
helper thread beside its student (`pipelines.align.worker_state.SpareCores`): the rows, statistics and dead
letters must be exactly those of encoding them in turn.

The align DoFn is called directly (no Beam), once as a lone worker and once in the tail state.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pyarrow as pa
import pytest

from pipelines.align import align_dofns as F
from pipelines.align import worker_state
from pipelines.plumbing.tagged import DEAD, MAIN
from tokenbridge.alignment import WindowConfig
from tokenbridge.alignment.long_documents import PieceConfig


def test_spare_cores_only_once_a_bundle_of_several_has_finished():
    b = worker_state.SpareCores()
    assert not b.spare()  # nothing ran yet (a DoFn called outside Beam)
    b.started()
    assert not b.spare()  # one bundle at a time: the processes or in-process runner
    b.started()
    assert not b.spare()
    b.finished()
    assert b.spare()  # the threads runner's tail: a core is idle
    b.started()  # Dask gives the free thread another task: no helper again
    assert not b.spare()


@pytest.fixture(scope="module")
def texts(corpus_dir) -> list:
    with open(corpus_dir / "kjv.jsonl") as f:
        verses = [json.loads(next(f))["text"] for _ in range(200)]
    long_doc = " ".join(verses[:60])  # longer than the piece size below: goes in pieces
    # bytes: a tokenizer error (the batch is redone one document at a time); "": no tokens
    return [*verses[:100], long_doc, b"not text", "", *verses[100:]]


def _run(dirs, texts, bundles: worker_state.SpareCores, monkeypatch):
    monkeypatch.setattr(worker_state, "BUNDLES", bundles)
    teacher, student = dirs
    fn = F.AlignWindowsDoFn(
        str(student),
        [str(teacher)],
        window=WindowConfig(max_student_tokens=64, max_teacher_tokens=64),
        pieces=PieceConfig(piece_chars=2000, overlap_chars=200),
    )
    fn.setup()
    ids = [f"d{i}" for i in range(len(texts))]
    out = list(fn.process(F.DocBatch("f.jsonl", ids, texts, 0)))
    rows = pa.Table.from_batches([v.batch for tag, v in out if tag == MAIN])
    stats = sum(v.stats for tag, v in out if tag == MAIN)
    return rows, stats, [v for tag, v in out if tag == DEAD]


def test_encoding_beside_gives_the_same_rows_stats_and_dead_letters(
    teacher_dir, student_dir, texts, monkeypatch
):
    dirs = (teacher_dir, student_dir)
    rows, stats, dead = _run(dirs, texts, worker_state.SpareCores(), monkeypatch)
    tail = worker_state.SpareCores()
    tail.started(), tail.started(), tail.finished()  # one of two workers done
    rows_b, stats_b, dead_b = _run(dirs, texts, tail, monkeypatch)
    assert tail._helper is not None  # the teachers did go to the helper thread
    assert any(t.name.startswith("encode-beside") for t in threading.enumerate())
    assert rows.num_rows > len(texts) and rows_b.equals(rows)
    assert np.array_equal(stats_b, stats)
    reasons = sorted(d["reason"] for d in dead)
    assert reasons == sorted([F.TOKENIZER_ERROR, F.NO_TOKENS]) and dead_b == dead
