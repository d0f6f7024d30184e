"""The align job on a real distributed engine: Beam's DaskRunner over a loopback LocalCluster
(two worker processes), giving the same shards, stats and dead letters as the FnApiRunner.

The teacher here is the Phi-3 vocabulary (SentencePiece with byte fallback, like Gemma, but it
loads in a second where Gemma's 262k vocabulary takes ~10-30 s in every fresh worker process)."""

from __future__ import annotations

import json

from dask.distributed import LocalCluster

from pipelines import align_job as J
from pipelines import schema as S
from pipelines import shards

SKIP_KEYS = {"wall_s", "metrics"}


def test_dask_local_cluster_matches_fnapi_runner(tmp_path, pair_paths, vocab_fixture, corpus_dir):
    t, s = str(vocab_fixture("phi-3")), pair_paths[1]
    data = tmp_path / "data"
    data.mkdir()
    plays = sorted((corpus_dir / "shakespeare").glob("*.txt"))[:2]
    for i, play in enumerate(plays):
        (data / f"play{i}.txt").write_text(play.read_text()[:3000])
    verses = (corpus_dir / "kjv.jsonl").read_text().splitlines()[:40]
    (data / "verses.jsonl").write_text("\n".join([*verses, '{"no_text": 1}']) + "\n")
    (data / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    base = ["--data", f"{data}/*", "--teacher", t, "--student", s, "--num-shards", "2"]
    base += ["--max-student-tokens", "64", "--max-teacher-tokens", "64"]

    fn_stats = J.run([*base, "--out", str(tmp_path / "fn")])
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    ) as cluster:
        dask_stats = J.run(
            [
                *base,
                "--out",
                str(tmp_path / "dask"),
                "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
                f"--dask_client_address={cluster.scheduler_address}",
                "--dask_npartitions=2",
            ]
        )
    assert fn_stats["documents"] == 2 + 40 and fn_stats["drops_by_reason"] == {
        "missing_field": 1,
        "undecodable_utf8": 1,
    }
    assert {k: v for k, v in dask_stats.items() if k not in SKIP_KEYS} == {
        k: v for k, v in fn_stats.items() if k not in SKIP_KEYS
    }
    fn_set, dask_set = shards.open_shards(tmp_path / "fn"), shards.open_shards(tmp_path / "dask")
    assert [p.name for p in dask_set.files] == [p.name for p in fn_set.files]
    for a, b in zip(fn_set.files, dask_set.files):
        assert shards.open_shards(tmp_path / "dask").table().num_rows == fn_set.num_rows
        assert a.read_bytes() == b.read_bytes()  # byte-identical shards
    dead = [
        json.loads(x) for x in (tmp_path / "dask" / S.DEAD_LETTER_FILE).read_text().splitlines()
    ]
    assert sorted(d["reason"] for d in dead) == ["missing_field", "undecodable_utf8"]
