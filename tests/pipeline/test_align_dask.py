"""The align job on a real distributed engine: Beam's DaskRunner over a loopback LocalCluster
(two worker processes), giving the same rows, stats and dead letters as the FnApiRunner (the
rows' order and their split into rolled files depend on the runner's bundles).

Both write to an S3 server as well (SeaweedFS on loopback, `bench.storage.seaweed`): the
FnApiRunner's objects are the bytes of its local run, file for file, and the Dask workers, which
get no pipeline options from Beam, find the server through the AWS variables they inherit (the
Dask run reads its input from the server too).

The teacher here is the Phi-3 vocabulary (SentencePiece with byte fallback, like Gemma, but it
loads in a second where Gemma's 262k vocabulary takes ~10-30 s in every fresh worker process)."""

from __future__ import annotations

import json

from dask.distributed import LocalCluster

from pipelines.align import job as J
from tokenbridge.formats import shard_schema as S
from tokenbridge.formats import shards

SKIP_KEYS = {"wall_s", "metrics", "shards"}  # files roll per bundle: runners differ
SKIP_DASK = {*SKIP_KEYS, "data"}  # the Dask run reads the same files from s3://


def test_dask_local_cluster_matches_fnapi_runner(
    tmp_path, pair_paths, vocab_fixture, corpus_dir, s3_server, s3_bucket
):
    t, s = str(vocab_fixture("phi-3")), pair_paths[1]
    data = tmp_path / "data"
    data.mkdir()
    plays = sorted((corpus_dir / "shakespeare").glob("*.txt"))[:2]
    for i, play in enumerate(plays):
        (data / f"play{i}.txt").write_text(play.read_text()[:3000])
    verses = (corpus_dir / "kjv.jsonl").read_text().splitlines()[:40]
    (data / "verses.jsonl").write_text("\n".join([*verses, '{"no_text": 1}']) + "\n")
    (data / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    base = ["--data", f"{data}/*", "--teacher", t, "--student", s, "--shard-mb", "0.01"]
    base += ["--max-student-tokens", "64", "--max-teacher-tokens", "64"]

    fn_stats = J.run([*base, "--out", str(tmp_path / "fn"), "--direct_num_workers", "1"])
    s3_stats = J.run([*base, "--out", f"s3://{s3_bucket}/fn", "--direct_num_workers", "1"])
    marker = json.loads((tmp_path / "fn" / S.COMPLETED_MARKER).read_text())
    s3_copy = s3_server.download(s3_bucket, "fn", tmp_path / "fn_s3")
    assert sorted(p.name for p in s3_copy.iterdir()) == sorted([*marker["checksums"], "COMPLETED"])
    for name in [*marker["checksums"], S.COMPLETED_MARKER]:  # the same bytes, file for file
        assert (s3_copy / name).read_bytes() == (tmp_path / "fn" / name).read_bytes(), name
    assert {k: v for k, v in s3_stats.items() if k not in SKIP_KEYS} == {
        k: v for k, v in fn_stats.items() if k not in SKIP_KEYS
    }
    # the Dask workers read their input from the store too (Beam hands them no options)
    s3_data = s3_server.upload(data, s3_bucket, "data")
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    ) as cluster:
        dask_stats = J.run(
            [
                *[f"{s3_data}/*" if a == f"{data}/*" else a for a in base],
                "--out",
                f"s3://{s3_bucket}/dask",
                "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
                f"--dask_client_address={cluster.scheduler_address}",
                "--dask_npartitions=2",
            ]
        )
    assert fn_stats["documents"] == 2 + 40 and fn_stats["drops_by_reason"] == {
        "missing_field": 1,
        "undecodable_utf8": 1,
    }
    assert {k: v for k, v in dask_stats.items() if k not in SKIP_DASK} == {
        k: v for k, v in fn_stats.items() if k not in SKIP_DASK
    }
    s3_server.download(s3_bucket, "dask", tmp_path / "dask")
    fn_set, dask_set = shards.open_shards(tmp_path / "fn"), shards.open_shards(tmp_path / "dask")
    assert len(dask_set.files) > 1  # rolled files, written by the Dask workers
    order = [("doc_id", "ascending"), ("window", "ascending")]
    assert dask_set.table().sort_by(order).equals(fn_set.table().sort_by(order))  # same rows
    dead = [
        json.loads(x) for x in (tmp_path / "dask" / S.DEAD_LETTER_FILE).read_text().splitlines()
    ]
    assert sorted(d["reason"] for d in dead) == ["missing_field", "undecodable_utf8"]
