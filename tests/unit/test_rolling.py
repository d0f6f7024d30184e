"""Rolling part files and the finalize protocol: roll at a size, manifests with checksums computed
while writing, only referenced and closed parts published, in key order, idempotently."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import xxhash

from pipelines.plumbing import rolling
from tokenbridge.formats import shard_schema, shards

STUDENT = shard_schema.TokenizerInfo("student-tok", "a" * 64, 100)
TEACHERS = [shard_schema.TokenizerInfo("teacher-a", "b" * 64, 300)]


def _batch(doc: int, n: int) -> pa.RecordBatch:
    schema = shard_schema.shard_schema(STUDENT, TEACHERS)
    rows = []
    for w in range(n):
        row = {"doc_id": f"doc{doc:03d}", "window": w, "char_start": 0, "char_end": 1, "text": "x"}
        row |= {"student_ids": [1, 2], "teacher0_ids": [3], "teacher0_chunk": [0]}
        row |= {"teacher0_student_chunk": [0, 0], "teacher0_n_chunks": 1}
        rows.append(row)
    return pa.RecordBatch.from_pylist(rows, schema=schema)


def test_parts_roll_and_manifests_hash_the_bytes(tmp_path):
    parts = rolling.RollingParts(tmp_path, kind="shard", fmt="arrow", roll_bytes=2000)
    names = [parts.write(_batch(d, 5)) for d in range(6)]
    parts.close()
    assert len(set(names)) > 2  # rolled several times
    for name in set(names):
        manifest = rolling.read_manifest(tmp_path, name)
        data = (tmp_path / name).read_bytes()
        assert manifest["bytes"] == len(data)
        assert manifest["xxh3_64"] == xxhash.xxh3_64(data).hexdigest()
        rows = pa.ipc.open_file(pa.py_buffer(data)).read_all().num_rows
        assert manifest["rows"] == rows == 5 * names.count(name)


def test_jsonl_parts_and_sorted_concat(tmp_path):
    parts = rolling.RollingParts(tmp_path, kind="dead", fmt="jsonl", roll_bytes=60)
    names = [parts.write([{"reason": r, "row": i}]) for i, r in enumerate("cab")]
    parts.close()
    info = rolling.concat_parts(
        tmp_path, list(set(names)), tmp_path / "all.jsonl", sort_below=1 << 20
    )
    lines = (tmp_path / "all.jsonl").read_text().splitlines()
    assert [json.loads(x)["reason"] for x in lines] == ["a", "b", "c"] and info["rows"] == 3
    info = rolling.concat_parts(tmp_path, list(set(names)), tmp_path / "all.jsonl", sort_below=0)
    assert info["rows"] == 3 and len((tmp_path / "all.jsonl").read_text().splitlines()) == 3


def test_finalize_publishes_referenced_parts_in_key_order(tmp_path):
    tmp, out = tmp_path / ".align-tmp-x", tmp_path
    a = rolling.RollingParts(tmp, kind="shard", fmt="arrow", roll_bytes=1 << 30)
    b = rolling.RollingParts(tmp, kind="shard", fmt="arrow", roll_bytes=1 << 30)
    name_b = b.write(_batch(1, 3))
    name_a = a.write(_batch(7, 2))
    a.close()
    b.close()
    orphan = rolling.RollingParts(tmp, kind="shard", fmt="arrow", roll_bytes=1 << 30)
    orphan.write(_batch(0, 1))  # a failed bundle's part: closed, but no record names it
    orphan.close()
    parts = {name_a: {"rows": 2, "key": ("doc007", 0)}, name_b: {"rows": 3, "key": ("doc001", 0)}}
    index = rolling.finalize_parts(out, tmp, parts, name_for=shards.shard_name)
    assert list(index) == [shards.shard_name(0, 2), shards.shard_name(1, 2)]
    assert index[shards.shard_name(0, 2)]["rows"] == 3  # doc001 first
    assert sorted(p.name for p in out.glob("*.arrow")) == list(index)
    # idempotent: a retried finalize finds the parts already in place
    assert rolling.finalize_parts(out, tmp, parts, name_for=shards.shard_name) == index
    rolling.remove_tmp(tmp)
    assert not tmp.exists()


def test_finalize_refuses_unclosed_or_miscounted_parts(tmp_path):
    tmp = tmp_path / "t"
    parts = rolling.RollingParts(tmp, kind="shard", fmt="arrow", roll_bytes=1 << 30)
    name = parts.write(_batch(0, 4))  # never closed: no manifest, as after a crash
    with pytest.raises(RuntimeError, match="no manifest"):
        rolling.finalize_parts(
            tmp_path, tmp, {name: {"rows": 4, "key": ("d", 0)}}, name_for=shards.shard_name
        )
    parts.close()
    with pytest.raises(RuntimeError, match="4 rows on disk"):
        rolling.finalize_parts(
            tmp_path, tmp, {name: {"rows": 5, "key": ("d", 0)}}, name_for=shards.shard_name
        )
    parts.abort()  # nothing open: a no-op


def test_a_manifest_that_cannot_be_read_is_an_error_not_an_unclosed_part(tmp_path):
    """Only a missing or torn manifest means "never closed"; any other failure to read it (on an
    object store: the server gone mid-job) goes up as itself, not as an internal error."""
    tmp = tmp_path / "t"
    (tmp / ("p" + rolling.MANIFEST_SUFFIX)).mkdir(parents=True)  # unreadable: a directory
    with pytest.raises(IsADirectoryError):
        rolling.read_manifest(tmp, "p")
    (tmp / ("q" + rolling.MANIFEST_SUFFIX)).write_text('{"rows": ')  # torn
    assert rolling.read_manifest(tmp, "q") is None
    assert rolling.read_manifest(tmp, "absent") is None
