"""The align job on a real distributed engine: Beam's DaskRunner on a Dask cluster started as
users start one (``dask scheduler`` + two ``dask worker`` processes, each in its own directory
and HOME: `bench.daskcluster`), giving the same rows, stats and dead letters as the FnApiRunner
(the rows' order and their split into rolled files depend on the runner's bundles).

Both write to an S3 server as well (SeaweedFS on loopback, `bench.storage.seaweed`): the
FnApiRunner's objects are the bytes of its local run, file for file. The Dask workers share no
disk with this process: their arguments hold only URLs (the input, the output, and the
tokenizers, uploaded as marked directories whose local copies are deleted before the launch),
each worker fetches the tokenizers into its own cache, and finds the server through the AWS
variables of its environment (Beam hands Dask workers no pipeline options).

The teacher here is the Phi-3 vocabulary (SentencePiece with byte fallback, like Gemma, but it
loads in a second where Gemma's 262k vocabulary takes ~10-30 s in every fresh worker process)."""

from __future__ import annotations

import json

from bench.daskcluster import upload_model_dir
from pipelines.align import job
from tests.pipeline.conftest import local_paths
from tokenbridge import urls
from tokenbridge.formats import shard_schema, shards

SKIP_KEYS = {"wall_s", "metrics", "shards"}  # files roll per bundle: runners differ
SKIP_DASK = {*SKIP_KEYS, "data"}  # the Dask run reads the same files from s3://


def test_dask_local_cluster_matches_fnapi_runner(
    tmp_path, pair_paths, vocab_fixture, corpus_dir, s3_server, s3_bucket, dask_cluster, monkeypatch
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

    fn_stats = job.run([*base, "--out", str(tmp_path / "fn"), "--direct_num_workers", "1"])
    s3_stats = job.run([*base, "--out", f"s3://{s3_bucket}/fn", "--direct_num_workers", "1"])
    marker = json.loads((tmp_path / "fn" / shard_schema.COMPLETED_MARKER).read_text())
    s3_copy = s3_server.download(s3_bucket, "fn", tmp_path / "fn_s3")
    assert sorted(p.name for p in s3_copy.iterdir()) == sorted([*marker["checksums"], "COMPLETED"])
    for name in [
        *marker["checksums"],
        shard_schema.COMPLETED_MARKER,
    ]:  # the same bytes, file for file
        assert (s3_copy / name).read_bytes() == (tmp_path / "fn" / name).read_bytes(), name
    assert {k: v for k, v in s3_stats.items() if k not in SKIP_KEYS} == {
        k: v for k, v in fn_stats.items() if k not in SKIP_KEYS
    }
    # the Dask workers read everything from the store: the input, and the tokenizers, uploaded
    # as marked directories named as the local ones (same tokenizer names in the shards)
    s3_data = s3_server.upload(data, s3_bucket, "data")
    models = f"s3://{s3_bucket}/models"
    teacher = upload_model_dir(tmp_path / "up", f"{models}/ggml-vocab-phi-3", {"phi-3.gguf": t})
    student = upload_model_dir(tmp_path / "up", f"{models}/{urls.name(s)}", {
        n: f"{s}/{n}" for n in ("tokenizer.json", "tokenizer_config.json")})  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "launcher"))  # this process's copies
    remote = {f"{data}/*": f"{s3_data}/*", t: teacher, s: student}
    argv = [*[remote.get(a, a) for a in base], "--out", f"s3://{s3_bucket}/dask",
            "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
            f"--dask_client_address={dask_cluster.address}", "--dask_npartitions=2"]  # fmt: skip
    assert local_paths(argv) == []  # the workers are handed URLs only
    dask_stats = job.run(argv)
    # each worker that took tasks fetched the tokenizers itself (under load, Dask may give
    # every task to one worker: the other then fetches nothing)
    fetched = []
    for home in dask_cluster.worker_dirs():
        copies = {p.name for p in (home / ".cache" / "tokenbridge").glob("*/*") if p.is_dir()}
        assert not copies or {"ggml-vocab-phi-3", urls.name(s)} <= copies, (home, copies)
        fetched += [home] if copies else []
    assert fetched, "no Dask worker fetched the tokenizers"
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
        json.loads(x)
        for x in (tmp_path / "dask" / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()
    ]
    assert sorted(d["reason"] for d in dead) == ["missing_field", "undecodable_utf8"]
