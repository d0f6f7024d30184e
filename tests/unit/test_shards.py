"""Shard directories: atomic writes, COMPLETED last, and a reader that refuses what it must."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from tokenbridge.formats import shard_schema, shards

STUDENT = shard_schema.TokenizerInfo("student-tok", "a" * 64, 100)
TEACHERS = [
    shard_schema.TokenizerInfo("teacher-a", "b" * 64, 300),
    shard_schema.TokenizerInfo("teacher-b", "c" * 64, 50),
]


def _row(doc: int, window: int, n_s: int, n_t: list[int]) -> dict:
    rng = np.random.default_rng(doc * 100 + window)
    row = {
        "doc_id": f"doc{doc}",
        "window": window,
        "char_start": 10 * window,
        "char_end": 10 * window + 10,
        "text": f"text of {doc}/{window} ü",
        "student_ids": rng.integers(0, 100, n_s, dtype=np.int32),
    }
    for i, n in enumerate(n_t):
        row[shard_schema.teacher_ids_column(i)] = rng.integers(0, 50, n, dtype=np.int32)
        row[shard_schema.teacher_chunk_column(i)] = np.arange(n, dtype=np.int32) // 2
        row[shard_schema.teacher_student_chunk_column(i)] = np.arange(n_s, dtype=np.int32)
        row[shard_schema.teacher_n_chunks_column(i)] = max(
            n, n_s
        )  # every index below: values check it
    return row


def _rows(n: int) -> list[dict]:
    return [_row(d, w, 3 + d % 4, [2 + w, 5]) for d in range(n) for w in range(2)]


def _write_dir(tmp_path, rows, *, per_file=4, complete=True):
    schema = shard_schema.shard_schema(STUDENT, TEACHERS)
    files = {}
    chunks = [rows[i : i + per_file] for i in range(0, len(rows), per_file)]
    for i, part in enumerate(chunks):
        name = shards.shard_name(i, len(chunks))
        with shards.ShardWriter(tmp_path / name, schema) as w:
            w.write_rows(part)
        files[name] = len(part)
    if complete:
        stats = {"student": STUDENT.to_json(), "teachers": [t.to_json() for t in TEACHERS]}
        shards.write_completed(tmp_path, stats, files=files)
    return files


def test_roundtrip_rows_and_metadata(tmp_path):
    rows = _rows(5)
    files = _write_dir(tmp_path, rows)
    ss = shards.open_shards(tmp_path, student=STUDENT, teachers=TEACHERS)
    assert ss.num_rows == len(rows) and [p.name for p in ss.files] == sorted(files)
    assert ss.meta.student == STUDENT and ss.meta.teachers == TEACHERS
    table = ss.table()
    assert table.schema.equals(shard_schema.shard_schema(STUDENT, TEACHERS), check_metadata=True)
    for got, want in zip(table.to_pylist(), rows):
        for key, value in want.items():
            if isinstance(value, np.ndarray):
                assert got[key] == value.tolist(), key
            else:
                assert got[key] == value, key
    # iter_batches over a subset of files reads only those
    n_first = sum(b.num_rows for b in ss.iter_batches(files=ss.files[:1]))
    assert n_first == files[ss.files[0].name]
    marker = json.loads((tmp_path / shard_schema.COMPLETED_MARKER).read_text())
    assert marker["num_rows"] == len(rows)


def test_empty_list_rows():
    schema = shard_schema.shard_schema(STUDENT, TEACHERS[:1])
    rows = [_row(0, 0, 0, [0]), _row(1, 0, 4, [3])]
    batch = shards.rows_to_batch(rows, schema)
    assert batch.column("student_ids").to_pylist() == [[], rows[1]["student_ids"].tolist()]
    assert batch.schema.metadata == schema.metadata


def test_missing_column_is_a_clear_error():
    schema = shard_schema.shard_schema(STUDENT, TEACHERS)
    row = _row(0, 0, 3, [2])  # only one teacher's columns
    with pytest.raises(ValueError, match="teacher1_ids"):
        shards.rows_to_batch([row], schema)


def test_writer_is_atomic_on_error(tmp_path):
    schema = shard_schema.shard_schema(STUDENT, TEACHERS)
    path = tmp_path / shards.shard_name(0, 1)
    with pytest.raises(RuntimeError, match="boom"), shards.ShardWriter(path, schema) as w:
        w.write_rows(_rows(2))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []  # neither the shard nor its temporary file


def test_writer_rejects_a_foreign_schema(tmp_path):
    schema = shard_schema.shard_schema(STUDENT, TEACHERS)
    other = shard_schema.shard_schema(STUDENT, TEACHERS[:1])
    batch = shards.rows_to_batch([_row(0, 0, 2, [2])], other)
    with (
        pytest.raises(ValueError, match="schema differs"),
        shards.ShardWriter(tmp_path / "x.arrow", schema) as w,
    ):
        w.write_batch(batch)


def test_refuses_dir_without_completed(tmp_path):
    _write_dir(tmp_path, _rows(2), complete=False)
    with pytest.raises(shards.IncompleteShardsError, match="COMPLETED"):
        shards.open_shards(tmp_path)


def test_refuses_missing_listed_file_and_ignores_stale_ones(tmp_path):
    files = _write_dir(tmp_path, _rows(4))
    # a stale shard of an earlier run is not listed, hence not read
    stale = tmp_path / shards.shard_name(7, 9)
    (tmp_path / next(iter(files))).rename(stale)
    with pytest.raises(shards.IncompleteShardsError, match="missing"):
        shards.open_shards(tmp_path)
    stale.rename(tmp_path / next(iter(files)))
    (tmp_path / shards.shard_name(8, 9)).write_bytes(stale.name.encode())
    assert shards.open_shards(tmp_path).num_rows == 8


def test_refuses_other_fingerprints(tmp_path):
    _write_dir(tmp_path, _rows(2))
    other = shard_schema.TokenizerInfo("student-tok", "d" * 64, 100)
    with pytest.raises(shards.FingerprintMismatchError, match="student tokenizer fingerprint"):
        shards.open_shards(tmp_path, student=other)
    with pytest.raises(shards.FingerprintMismatchError, match="teacher 1"):
        shards.open_shards(tmp_path, teachers=[TEACHERS[0], other])
    with pytest.raises(shards.FingerprintMismatchError, match="2 teacher"):
        shards.open_shards(tmp_path, teachers=TEACHERS[:1])


def test_refuses_other_schema_version(tmp_path):
    _write_dir(tmp_path, _rows(2))
    marker = json.loads((tmp_path / shard_schema.COMPLETED_MARKER).read_text())
    marker["schema_version"] = shard_schema.SCHEMA_VERSION + 1
    (tmp_path / shard_schema.COMPLETED_MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="schema version"):
        shards.open_shards(tmp_path)


def test_row_count_mismatch_and_garbage_file(tmp_path):
    files = _write_dir(tmp_path, _rows(2), per_file=10)
    name = next(iter(files))
    marker = json.loads((tmp_path / shard_schema.COMPLETED_MARKER).read_text())
    marker["files"][name] += 1
    (tmp_path / shard_schema.COMPLETED_MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="rows"):
        shards.open_shards(tmp_path)
    (tmp_path / name).write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match="damaged: expected xxh3_64 .* over 16 bytes"):
        shards.open_shards(tmp_path)  # the checksum says what happened
    del marker["checksums"][name]
    (tmp_path / shard_schema.COMPLETED_MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="not a readable Arrow IPC file"):
        shards.open_shards(tmp_path)  # no checksum to compare: Arrow's error, in one line


def test_write_completed_refuses_missing_files_and_counts_by_default(tmp_path):
    with pytest.raises(FileNotFoundError):
        shards.write_completed(tmp_path, {}, files={"shard-00000-of-00001.arrow": 3})
    assert not (tmp_path / shard_schema.COMPLETED_MARKER).exists()
    _write_dir(tmp_path, _rows(3), complete=False)
    shards.write_completed(tmp_path, {"x": 1})
    assert shards.open_shards(tmp_path).num_rows == 6
    assert shards.open_shards(tmp_path).stats() == {"x": 1}


def test_empty_run_reads_metadata_from_stats(tmp_path):
    stats = {"student": STUDENT.to_json(), "teachers": [t.to_json() for t in TEACHERS]}
    shards.write_completed(tmp_path, stats, files={})
    assert shards.write_dead_letters(tmp_path, [{"reason": "empty"}, {"reason": "a"}]) == 2
    ss = shards.open_shards(tmp_path, student=STUDENT, teachers=TEACHERS)
    assert ss.num_rows == 0 and ss.table().num_rows == 0
    lines = (tmp_path / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()
    assert [json.loads(x)["reason"] for x in lines] == ["a", "empty"]


def test_list_array_offsets_are_exact():
    values = [np.array([1, 2], np.int32), np.zeros(0, np.int32), np.array([7], np.int32)]
    arr = shards._list_array(values)
    assert arr.type == pa.list_(pa.int32())
    assert arr.to_pylist() == [[1, 2], [], [7]]


def test_windows_to_batch_equals_rows_of_window_to_row():
    from tokenbridge.alignment import Window

    rng = np.random.default_rng(1)

    def window(doc: int, k: int) -> Window:
        n_s, n_t = 2 + k, [3 + k, 1]
        return Window(
            window=k,
            char_start=5 * k,
            char_end=5 * k + 5,
            text=f"w{doc}.{k} é",
            student_ids=rng.integers(0, 99, n_s, dtype=np.int32),
            teacher_ids=[rng.integers(0, 49, n, dtype=np.int32) for n in n_t],
            teacher_chunk=[np.arange(n, dtype=np.int32) - 1 for n in n_t],
            teacher_student_chunk=[np.arange(n_s, dtype=np.int32) - 1 for _ in n_t],
            teacher_n_chunks=[n - 1 for n in n_t],
        )

    items = [(f"doc{d}", window(d, k)) for d in range(3) for k in range(3)]
    schema = shard_schema.shard_schema(STUDENT, TEACHERS)
    fast = shards.windows_to_batch(items, schema)
    slow = shards.rows_to_batch([shards.window_to_row(d, w) for d, w in items], schema)
    assert fast.equals(slow) and fast.schema.equals(schema, check_metadata=True)
    with pytest.raises(ValueError, match="other than 1 teacher"):
        shards.windows_to_batch(items, shard_schema.shard_schema(STUDENT, TEACHERS[:1]))


def test_marker_v3_checksums_and_v2_v1_still_read(tmp_path):
    import hashlib

    import xxhash

    files = _write_dir(tmp_path, _rows(2))
    marker = json.loads((tmp_path / shard_schema.COMPLETED_MARKER).read_text())
    assert marker["version"] == shards.COMPLETED_VERSION == 3 and marker["hash"] == "xxh3_64"
    data = (tmp_path / shard_schema.STATS_FILE).read_bytes()
    assert marker["checksums"][shard_schema.STATS_FILE] == {
        "bytes": len(data),
        "xxh3_64": xxhash.xxh3_64(data).hexdigest(),
    }
    for name in files:  # computed while ShardWriter wrote the file, equal to one from disk
        shard = (tmp_path / name).read_bytes()
        assert marker["checksums"][name]["xxh3_64"] == xxhash.xxh3_64(shard).hexdigest()
    assert shards.open_shards(tmp_path).checksums == marker["checksums"]
    # version 2 recorded blake2b: still verified, by the algorithm each entry names
    v2 = dict(marker, version=2, checksums={
        n: {"bytes": e["bytes"], "blake2b": hashlib.blake2b(
            (tmp_path / n).read_bytes(), digest_size=16).hexdigest()}
        for n, e in marker["checksums"].items()})  # fmt: skip
    (tmp_path / shard_schema.COMPLETED_MARKER).write_text(json.dumps(v2))
    assert shards.open_shards(tmp_path, verify="preflight").num_rows == sum(files.values())
    # a directory written before marker version 2 (no checksums) still opens
    v1 = {k: marker[k] for k in ("schema_version", "files", "num_rows")} | {"version": 1}
    (tmp_path / shard_schema.COMPLETED_MARKER).write_text(json.dumps(v1))
    ss = shards.open_shards(tmp_path)
    assert ss.num_rows == sum(files.values()) and ss.checksums == {}
    (tmp_path / shard_schema.COMPLETED_MARKER).write_text(json.dumps(v1 | {"version": 9}))
    with pytest.raises(ValueError, match="rebuild"):
        shards.open_shards(tmp_path)


def test_schema_1_text_shards_still_read_and_unknown_versions_refused(tmp_path):
    """Shards written before conversations (schema 1: text columns only) open and read as text;
    a version this code does not know is refused, saying how to rebuild."""
    from trainer.data.shard_reader import ShardReader

    schema = shard_schema.shard_schema(STUDENT, TEACHERS)
    v1 = schema.with_metadata({**schema.metadata, shard_schema.META_SCHEMA_VERSION: b"1"})
    rows = _rows(2)
    with shards.ShardWriter(tmp_path / shards.shard_name(0, 1), v1) as w:
        w.write_rows(rows)
    stats = {"student": STUDENT.to_json(), "teachers": [t.to_json() for t in TEACHERS]}
    shards.write_completed(tmp_path, stats, files={shards.shard_name(0, 1): len(rows)})
    marker = json.loads((tmp_path / shard_schema.COMPLETED_MARKER).read_text())
    (tmp_path / shard_schema.COMPLETED_MARKER).write_text(
        json.dumps(marker | {"schema_version": 1})
    )
    ss = shards.open_shards(tmp_path)
    assert ss.meta.schema_version == 1 and not ss.meta.is_chat
    assert ss.schema.metadata[shard_schema.META_SCHEMA_VERSION] == b"1"
    reader = ShardReader(ss, max_student_tokens=64)
    row = reader.row(0)
    assert "train" not in row and np.array_equal(row["student_ids"], rows[0]["student_ids"])
    with pytest.raises(ValueError, match=r"version 7.*rebuild.*make align"):
        shard_schema.check_version(7, where="x")
    bad = schema.with_metadata({**schema.metadata, shard_schema.META_SCHEMA_VERSION: b"7"})
    with pytest.raises(ValueError, match="x: shard schema version 7"):
        shard_schema.read_meta(bad, where="x")
