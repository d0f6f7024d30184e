"""The jobs against a real S3 server (SeaweedFS on loopback, `bench.storage.seaweed`): a projection
uploaded whole, and the failures a user meets: refused credentials and a missing input (one
line each, exit 2), and a server whose endpoint dies while the align job uploads (the job fails, no
COMPLETED; once the server is back, a re-run starts over and completes). The align job's output
compared with a local run, byte for byte, and on Dask: tests/pipeline/test_align_dask.py; the
teacher cache on S3: tests/pipeline/test_teacher_cache_job.py. Reads while the endpoint is down
are retried with backoff until it is back (`tokenbridge.urls.retry_config`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from apache_beam.utils import retry
from safetensors import safe_open

from bench.storage.seaweed import SeaweedS3
from pipelines.align import job as align_job
from pipelines.plumbing import storage
from pipelines.projection.__main__ import main as projection_job
from tokenbridge import cli, remote_cache
from tokenbridge.formats import shard_schema


@pytest.fixture
def align_args(tmp_path, vocab_fixture, student_dir, corpus_dir):
    """A small align job (Phi-3's vocabulary as the teacher: it loads in a second), in this
    process; the caller adds --out."""
    data = tmp_path / "data"
    data.mkdir()
    for i, play in enumerate(sorted((corpus_dir / "shakespeare").glob("*.txt"))[:3]):
        (data / f"play{i}.txt").write_text(play.read_text()[:20_000])
    return ["--data", f"{data}/*", "--teacher", str(vocab_fixture("phi-3")),
            "--student", str(student_dir), "--max-student-tokens", "64",
            "--max-teacher-tokens", "64", "--shard-mb", "0.005", "--direct_num_workers", "1"]  # fmt: skip


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_projection_is_uploaded_whole(s3_server, s3_bucket, student_dir, tmp_path):
    url = f"s3://{s3_bucket}/proj/smollm2__smollm2__k2.safetensors"
    assert projection_job(["--teacher", str(student_dir), "--student", str(student_dir),
                           "--k", "2", "--out", url]) == url  # fmt: skip
    assert s3_server.keys(s3_bucket) == ["proj/smollm2__smollm2__k2.safetensors"]
    copy = s3_server.download(s3_bucket, "proj", tmp_path / "proj")
    with safe_open(str(copy / "smollm2__smollm2__k2.safetensors"), "np") as f:
        assert f.metadata()["k"] == "2"


def test_refused_credentials_and_missing_input_are_one_line(
    s3_server, s3_bucket, align_args, capsys, monkeypatch, tmp_path
):
    out = f"s3://{s3_bucket}/shards"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert cli.run(align_job.main, [*align_args, "--out", out], prog="align") == cli.EXIT_USAGE
    line = one_line(capsys)
    assert f"StorageAccessError: {out}/COMPLETED: the object store refused" in line, line
    assert "AWS_SECRET_ACCESS_KEY" in line
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.env()["AWS_SECRET_ACCESS_KEY"])
    missing = f"s3://{s3_bucket}/corpus/*.txt"
    argv = [*align_args, "--out", out]
    argv[argv.index("--data") + 1] = missing
    assert cli.run(align_job.main, argv, prog="align") == cli.EXIT_USAGE
    assert f"FileNotFoundError: --data '{missing}' matches no file" in one_line(capsys)
    assert s3_server.keys(s3_bucket) == []  # nothing written by either
    # an input that is there is read through Beam's FileSystems (the AWS variables mapped)
    local = align_args[align_args.index("--data") + 1].rstrip("*")
    s3_server.upload(Path(local) / "play0.txt", s3_bucket, "corpus/play0.txt")
    argv[argv.index("--out") + 1] = str(tmp_path / "from_s3")
    stats = align_job.run(argv)
    assert stats["input_files"] == 1 and stats["windows"] > 0 and stats["dead_letters"] == 0


def test_server_killed_mid_upload_leaves_no_completed_and_a_rerun_starts_over(
    tmp_path, align_args, monkeypatch, capsys
):
    """Its own server, whose S3 endpoint is killed (SIGKILL) once the job has uploaded its
    first parts, and restarted on the same data and port."""
    server = SeaweedS3(tmp_path / "weed").start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        # a dead server is retried: by boto3 (fewer attempts here), and by Beam's S3 uploader,
        # 7 times over ~10 minutes of backoff, whose waits this test does not sit through
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
        monkeypatch.setattr(retry.Clock, "sleep", lambda self, seconds: None)
        bucket = server.new_bucket()
        server.client().put_object(Bucket=bucket, Key="probe", Body=b"ok")
        out = f"s3://{bucket}/shards"
        code: list[int] = []
        job = threading.Thread(
            target=lambda: code.append(
                cli.run(align_job.main, [*align_args, "--out", out], prog="align")
            )
        )
        job.start()
        deadline = time.monotonic() + 120
        while not any(k.endswith(".done") for k in server.keys(bucket)):  # a part is closed
            assert job.is_alive() and time.monotonic() < deadline, "no part was uploaded"
            time.sleep(0.02)
        server.kill_gateway()
        job.join(timeout=300)
        assert code == [cli.EXIT_RUN]
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("tokenbridge align: ") and "internal error" not in line, line
        # reads while the endpoint is down wait for it (botocore's backoff), both clients
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "10")
        back = threading.Timer(1.0, server.start_gateway)
        back.start()
        assert storage.read_bytes(f"s3://{bucket}/probe") == b"ok"  # Beam's S3 I/O
        back.join()
        server.kill_gateway()
        back = threading.Timer(1.0, server.start_gateway)
        back.start()
        assert remote_cache.filesystem().cat_file(f"{bucket}/probe") == b"ok"  # s3fs (fetches)
        back.join()
        keys = server.keys(bucket)
        assert f"shards/{shard_schema.COMPLETED_MARKER}" not in keys
        assert not [k for k in keys if k.startswith("shards/shard-")], keys
        assert any(k.startswith("shards/.align-tmp-") for k in keys)  # the dead run's debris
        stats = align_job.run([*align_args, "--out", out])  # starts over: no --overwrite needed
        keys = server.keys(bucket)
        assert f"shards/{shard_schema.COMPLETED_MARKER}" in keys and stats["windows"] > 0
        assert not [k for k in keys if k.startswith("shards/.align-tmp-")], keys
        assert len([k for k in keys if k.startswith("shards/shard-")]) == stats["shards"]
    finally:
        server.stop()
