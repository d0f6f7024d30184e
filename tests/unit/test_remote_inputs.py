"""The trainer's node-local cache of object-store inputs, against the test S3 server: a marked
directory fetched and verified (a changed object refused by name, a missing marker refused as
an unfinished job), the node's other ranks waiting for its one fetch, reuse, and eviction of the
least recently used entries under the size limit; checkpoints in a store resumed from the
newest that verifies."""

from __future__ import annotations

import threading
import time

import pytest

from tokenbridge import urls
from tokenbridge.formats import checksums, shards
from tokenbridge.remote_cache import FETCHED, RemoteCache
from trainer.checkpoint import remote
from trainer.checkpoint.dcp_io import DamagedCheckpointError
from trainer.config.sections import CheckpointConfig


def upload_marked(
    s3_server, bucket: str, prefix: str, tmp_path, files: dict[str, bytes], kind=shards.KIND
) -> str:
    """`files` and a COMPLETED marker (their checksums, as a job writes it) under prefix/."""
    local = tmp_path / prefix
    local.mkdir(parents=True)
    for name, data in files.items():
        (local / name).write_bytes(data)
    docs = shards.completed_documents(
        {"kind": "test"},
        files={n: 1 for n in files},
        checksums={n: checksums.hash_file(local / n) for n in files},
        kind=kind,
    )
    client = s3_server.client()
    for name, data in {**files, **docs}.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    return f"s3://{bucket}/{prefix}"


def test_fetch_verifies_and_the_nodes_other_ranks_wait(s3_server, s3_bucket, tmp_path):
    url = upload_marked(s3_server, s3_bucket, "a", tmp_path / "src", {"x.arrow": b"x" * 1000,
                                                                      "y.arrow": b"y" * 10})  # fmt: skip
    root = tmp_path / "cache"
    got: list = []
    waiter = threading.Thread(
        target=lambda: got.append(RemoteCache(root, limit_bytes=10**6, local_rank=1).fetch_dir(url))
    )
    waiter.start()  # local rank 1 first: it waits for rank 0's fetch
    entry = RemoteCache(root, limit_bytes=10**6, local_rank=0).fetch_dir(url)
    waiter.join(timeout=30)
    assert got == [entry] and (entry / FETCHED).is_file()
    assert (entry / "x.arrow").read_bytes() == b"x" * 1000
    assert checksums.verify_dir(entry) and all(r.ok for r in checksums.verify_dir(entry))
    assert sorted(p.name for p in entry.iterdir()) == [
        FETCHED, "COMPLETED", "stats.json", "x.arrow", "y.arrow"
    ]  # fmt: skip
    # fetched once: a second run on this node reads the copy, even with the object gone
    s3_server.client().delete_object(Bucket=s3_bucket, Key="a/x.arrow")
    assert RemoteCache(root, limit_bytes=10**6, local_rank=0).fetch_dir(url) == entry


def test_changed_object_missing_marker_refused_credentials_and_eviction(
    s3_server, s3_bucket, tmp_path, monkeypatch
):
    url = upload_marked(s3_server, s3_bucket, "a", tmp_path / "src", {"x.arrow": b"x" * 100})
    s3_server.client().put_object(Bucket=s3_bucket, Key="a/x.arrow", Body=b"z" * 100)
    root = tmp_path / "cache"
    cache = RemoteCache(root, limit_bytes=10**6, local_rank=0)
    with pytest.raises(checksums.DamagedFileError, match=rf"^{url}/x.arrow: damaged: expected"):
        cache.fetch_dir(url)
    # nothing half-fetched is left to be taken for a copy (the entry's lock file stays)
    assert [p.name for p in root.iterdir()] == [".locks"]
    with pytest.raises(FileNotFoundError, match=rf"^s3://{s3_bucket}/none/COMPLETED: no comp"):
        cache.fetch_dir(f"s3://{s3_bucket}/none")
    with monkeypatch.context() as m:  # refused credentials: one line naming the URL (exit 2)
        m.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(urls.StorageAccessError, match=rf"^{url}/COMPLETED: the object store"):
            cache.fetch_dir(url)
    # a limit of 1.5 entries: each new fetch evicts the least recently used other one
    b = upload_marked(s3_server, s3_bucket, "b", tmp_path / "src", {"x.arrow": b"b" * 400})
    c = upload_marked(s3_server, s3_bucket, "c", tmp_path / "src", {"x.arrow": b"c" * 400})
    first = RemoteCache(root, limit_bytes=1000, local_rank=0).fetch_dir(b)
    second = RemoteCache(root, limit_bytes=1000, local_rank=0).fetch_dir(c)
    assert not first.exists() and (second / FETCHED).is_file()
    with pytest.raises(ValueError, match=r"does not fit the local cache \(data.cache_limit_gb"):
        RemoteCache(root, limit_bytes=100, local_rank=0).fetch_dir(b)


def test_checkpoints_in_a_store_resume_from_the_newest_that_verifies(
    s3_server, s3_bucket, tmp_path
):
    """Committed steps are those with COMPLETED; a damaged newest one is passed over for the
    older one (checkpoint.strict=true: refused), an unfinished one is not listed at all."""
    src = tmp_path / "src"
    for step in (2, 4):
        upload_marked(s3_server, s3_bucket, f"ckpt/step-0000000{step}", src, {"a": b"s%d" % step})
    s3_server.client().put_object(Bucket=s3_bucket, Key="ckpt/step-00000004/a", Body=b"xx")
    s3_server.client().put_object(Bucket=s3_bucket, Key="ckpt/step-00000006/a", Body=b"x")
    folder = f"s3://{s3_bucket}/ckpt"
    assert [s for s, _ in remote.list_steps(folder)] == [2, 4]
    path, notes = remote.find_resume(
        folder, CheckpointConfig(), cache_dir=tmp_path / "cache", limit_bytes=10**6
    )
    assert (path / "a").read_bytes() == b"s2"
    assert len(notes) == 1 and notes[0].startswith(f"checkpoint {folder}/step-00000004 is damaged")
    assert notes[0].endswith("passed over; resuming from step-00000002")
    with pytest.raises(DamagedCheckpointError, match="checkpoint.strict=true refuses"):
        remote.find_resume(
            folder, CheckpointConfig(strict=True), cache_dir=tmp_path / "c2", limit_bytes=10**6
        )
    # checkpoint.resume naming a step: that one, verified (a damaged one refused, not passed over)
    named = CheckpointConfig(resume=f"{folder}/step-00000002")
    path, notes = remote.find_resume(folder, named, cache_dir=tmp_path / "c3", limit_bytes=10**6)
    assert (path / "a").read_bytes() == b"s2" and notes == []
    with pytest.raises(DamagedCheckpointError, match=r"^checkpoint.resume=s3://.*step-00000004: "):
        named = CheckpointConfig(resume=f"{folder}/step-00000004")
        remote.find_resume(folder, named, cache_dir=tmp_path / "c3", limit_bytes=10**6)


def test_two_fetchers_of_one_entry_download_it_once(s3_server, s3_bucket, tmp_path, monkeypatch):
    """Outside torchrun (two jobs, two Beam workers on one machine) every process is local
    rank 0: the entry's lock makes the second wait for the first's copy, not fetch again."""
    url = upload_marked(s3_server, s3_bucket, "two", tmp_path / "src", {"x.arrow": b"x" * 100})
    calls = []
    real = RemoteCache._download_dir

    def slow(self, *a, **kw):
        calls.append(1)
        time.sleep(0.3)  # long enough for the other thread to reach the lock
        return real(self, *a, **kw)

    monkeypatch.setattr(RemoteCache, "_download_dir", slow)
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(
            RemoteCache(tmp_path / "c", limit_bytes=10**6, local_rank=0).fetch_dir(url)))
        for _ in range(2)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1]
    assert (got[0] / "x.arrow").read_bytes() == b"x" * 100


def test_verify_reads_a_marked_directory_in_the_store(s3_server, s3_bucket, tmp_path, capsys):
    """``make verify DIR=s3://...``: every listed object hashed once (OK, then DAMAGED naming the
    changed one after it is overwritten); no marker: named, exit 2."""
    from tokenbridge.commands.verify import main as verify

    files = {"x.bin": b"x" * 100, "y.bin": b"y" * 50}  # not shards: no values to check
    url = upload_marked(s3_server, s3_bucket, "v", tmp_path / "src", files, kind="test")
    assert verify([url]) == 0
    out = capsys.readouterr().out
    assert "  OK       x.bin" in out and "  OK       y.bin" in out and f"{url}: 3 OK" in out
    assert out.count(", while streamed)") == 3  # each listed object (stats.json too), hashed once
    s3_server.client().put_object(Bucket=s3_bucket, Key="v/y.bin", Body=b"z" * 50)
    assert verify([url]) == 2
    out = capsys.readouterr().out
    assert "  OK       x.bin" in out and "  DAMAGED  y.bin: damaged: expected" in out
    assert verify([f"s3://{s3_bucket}/nothing"]) == 2
    assert "nothing: no COMPLETED marker" in capsys.readouterr().out
