"""Damaged shard directories, one per row of issue 20's table, and hand-built bad value_checks.

Each damage is done to bytes on disk the way a full disk or a bad copy does it, to a directory
written by the real writers (`ShardWriter`, `write_completed`); each must be refused with one
line naming the file and the expected and found checksum (or the row and column of a bad value),
by the reader and by ``python -m tokenbridge.commands.verify`` (exit code 2), before a row reaches a model.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tests.unit.test_shards import STUDENT, TEACHERS, _row, _rows, _write_dir
from tokenbridge.commands import verify
from tokenbridge.formats import checksums, shard_schema, shards, value_checks
from trainer.data.shard_reader import ShardReader

NAME = shards.shard_name(0, 2)


@pytest.fixture
def shard_dir(tmp_path):
    _write_dir(tmp_path, _rows(4), per_file=4)
    return tmp_path


def _batch_metadata_at(data: bytes) -> int:
    """Byte offset of the first record batch's flatbuffer metadata in an Arrow IPC file:
    magic (8), then the schema message (0xFFFFFFFF, length, metadata), then the batch's."""
    (schema_len,) = struct.unpack_from("<i", data, 12)
    return 8 + 8 + schema_len + 8


def _verify_cli(d, capsys) -> tuple[int, str]:
    code = verify.main([str(d)])
    return code, capsys.readouterr().out


def _one_line_damaged(err: str, path) -> None:
    assert "\n" not in err and str(path) in err
    assert "damaged: expected xxh3_64 " in err and ", found xxh3_64 " in err


def test_clean_directory_verifies_and_reads_the_same_rows_in_every_mode(shard_dir, capsys):
    code, out = _verify_cli(shard_dir, capsys)
    assert code == 0 and out.count("  OK  ") == 3 and "0 damaged" in out  # 2 shards, stats
    rows = {}
    for mode in checksums.VERIFY_MODES:
        reader = ShardReader(shards.open_shards(shard_dir, verify=mode), max_student_tokens=64)
        rows[mode] = [reader.row(i) for i in range(reader.num_rows)]
    for mode in ("preflight", "never"):
        for a, b in zip(rows["first_open"], rows[mode]):
            assert np.array_equal(a["student_ids"], b["student_ids"]) and a["text"] == b["text"]


def test_truncated_shard(shard_dir, capsys):
    path = shard_dir / NAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(checksums.DamagedFileError) as e:
        shards.open_shards(shard_dir, verify="never")  # footer unreadable: checksum says why
    _one_line_damaged(str(e.value), path)
    assert f"over {len(data)} bytes, found" in str(e.value)
    code, out = _verify_cli(shard_dir, capsys)
    assert code == 2 and f"DAMAGED  {NAME}: {path}: damaged" in out and "1 damaged" in out


def test_changed_record_batch_metadata(shard_dir, capsys):
    path = shard_dir / NAME
    data = bytearray(path.read_bytes())
    at = _batch_metadata_at(data)
    data[at + 24 : at + 40] = b"\xff" * 16  # what used to be a raw pyarrow OSError, unnamed
    path.write_bytes(bytes(data))
    with pytest.raises(checksums.DamagedFileError) as e:
        shards.open_shards(shard_dir)
    _one_line_damaged(str(e.value), path)
    assert _verify_cli(shard_dir, capsys)[0] == 2


def test_changed_data_buffer(shard_dir, capsys):
    """32 bytes inside student_ids: the checksum refuses the file; with verify=never the value
    check stops the row before the model, naming file, row and column."""
    path = shard_dir / NAME
    data = bytearray(path.read_bytes())
    first = _row(0, 0, 3, [2, 5])["student_ids"].tobytes()
    at = bytes(data).index(first)
    data[at : at + 32] = struct.pack("<i", 2_147_483_642) * 8
    path.write_bytes(bytes(data))
    with pytest.raises(checksums.DamagedFileError) as e:
        ShardReader(shards.open_shards(shard_dir), max_student_tokens=64)  # first_open
    _one_line_damaged(str(e.value), path)
    with pytest.raises(checksums.DamagedFileError):
        shards.open_shards(shard_dir, verify="preflight")
    reader = ShardReader(shards.open_shards(shard_dir, verify="never"), max_student_tokens=64)
    with pytest.raises(value_checks.BadValueError, match=rf"{NAME} row 0 column student_ids: value "
                       r"2147483642 at position 0 outside \[0, 100\)"):  # fmt: skip
        reader.row(0)
    code, out = _verify_cli(shard_dir, capsys)
    assert code == 2 and "DAMAGED" in out


def _bad_dir(tmp_path, edit) -> tuple:
    rows = _rows(3)
    edit(rows[3])
    _write_dir(tmp_path, rows, per_file=6)
    return shards.open_shards(tmp_path), tmp_path / shards.shard_name(0, 1)


@pytest.mark.parametrize(
    ("edit", "column", "detail"),
    [
        (lambda r: r["student_ids"].__setitem__(1, 100), "student_ids", "value 100 at position 1"),
        (lambda r: r["teacher1_ids"].__setitem__(0, -3), "teacher1_ids", r"value -3 .* \[0, 50\)"),
        (lambda r: r["teacher0_chunk"].__setitem__(-1, 99), "teacher0_chunk", "chunk index 99"),
        (lambda r: r.__setitem__("teacher1_n_chunks", -1), "teacher1_n_chunks", "-1 < 0"),
        (
            lambda r: r.__setitem__("teacher0_student_chunk", np.zeros(1, np.int32)),
            "teacher0_student_chunk",
            "length differs from student_ids",
        ),
    ],
)
def test_out_of_range_values_in_a_hand_built_shard(tmp_path, capsys, edit, column, detail):
    """Checksums are right (the writer wrote these values): the value checks catch them."""
    ss, path = _bad_dir(tmp_path, edit)
    reader = ShardReader(ss, max_student_tokens=64)
    with pytest.raises(value_checks.BadValueError, match=rf"row 3 column {column}: {detail}") as e:
        reader.row(0)  # the batch is checked whole when its first row is read
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    code, out = _verify_cli(tmp_path, capsys)
    assert code == 2 and f"row 3 column {column}" in out


def test_check_batch_costs_no_python_per_row():
    """A 200k-row batch checks in well under a second (numpy reductions only)."""
    import time

    n = 200_000
    batch = shards.rows_to_batch(
        [_row(0, 0, 3, [2, 5])], shard_schema.shard_schema(STUDENT, TEACHERS)
    )
    big = __import__("pyarrow").concat_tables([__import__("pyarrow").table(batch)] * n)
    b = big.combine_chunks().to_batches()[0]
    meta = shard_schema.ShardMeta(shard_schema.SCHEMA_VERSION, STUDENT, TEACHERS)
    t0 = time.perf_counter()
    value_checks.check_batch(b, meta, where="x")
    assert time.perf_counter() - t0 < 2.0


def test_missing_and_unlisted_files_and_v1_marker(shard_dir, capsys):
    (shard_dir / "stray.txt").write_text("x")
    (shard_dir / shard_schema.STATS_FILE).unlink()
    code, out = _verify_cli(shard_dir, capsys)
    assert code == 2 and "found no such file" in out and "stray.txt  (not listed" in out
    marker = json.loads((shard_dir / shard_schema.COMPLETED_MARKER).read_text())
    v1 = {k: marker[k] for k in ("schema_version", "files", "num_rows")} | {"version": 1}
    (shard_dir / shard_schema.COMPLETED_MARKER).write_text(json.dumps(v1))
    code, out = _verify_cli(shard_dir, capsys)
    assert code == 0 and "no checksum recorded (marker version 1)" in out


def test_verify_once_hashes_a_file_once_per_process(shard_dir):
    ss = shards.open_shards(shard_dir)
    e = ss.checksums[NAME]
    before = checksums.COST.bytes
    checksums.verify_once(shard_dir / NAME, e)
    assert checksums.verify_once(shard_dir / NAME, e) is False
    assert checksums.COST.bytes - before in (0, e["bytes"])


def _first_bad(rows: list[dict], meta: shard_schema.ShardMeta) -> tuple[int, str] | None:
    """The dense reference of `value_checks.check_batch`: the same checks, in the same column order,
    one Python comparison per element; (row, column) of the first failure, or None."""

    def in_range(col, lo, hi):
        return col, lambda r: all(lo <= int(v) < hi for v in r[col])

    checks = [in_range("student_ids", 0, meta.student.vocab_size)]
    for i, t in enumerate(meta.teachers):
        ids, n = shard_schema.teacher_ids_column(i), shard_schema.teacher_n_chunks_column(i)
        ch, sch = shard_schema.teacher_chunk_column(i), shard_schema.teacher_student_chunk_column(i)
        checks += [
            in_range(ids, 0, t.vocab_size),
            (n, lambda r, n=n: int(r[n]) >= 0),
            (
                ch,
                lambda r, n=n, c=ch, of=ids: (
                    all(-1 <= int(v) < int(r[n]) for v in r[c]) and len(r[c]) == len(r[of])
                ),
            ),  # fmt: skip
            (
                sch,
                lambda r, n=n, c=sch: (
                    all(-1 <= int(v) < int(r[n]) for v in r[c])
                    and len(r[c]) == len(r["student_ids"])
                ),
            ),  # fmt: skip
        ]
    for col, ok in checks:
        for j, r in enumerate(rows):
            if not ok(r):
                return j, col
    return None


def _damage(rows: list[dict], rng: np.random.Generator, meta: shard_schema.ShardMeta) -> None:
    """One edit to one random row: out of range (or just inside it), or a list one shorter."""
    r = rows[rng.integers(len(rows))]
    i = int(rng.integers(len(meta.teachers)))
    col = str(rng.choice(["student_ids", shard_schema.teacher_ids_column(i), shard_schema.teacher_n_chunks_column(i),
                          shard_schema.teacher_chunk_column(i), shard_schema.teacher_student_chunk_column(i)]))  # fmt: skip
    if col.endswith("n_chunks"):
        r[col] = int(rng.choice([-1, 0, 1, r[col] - 1, r[col]]))
    elif len(r[col]) and rng.random() < 0.2:
        r[col] = r[col][:-1].copy()
    elif len(r[col]):
        hi = {
            "student_ids": meta.student.vocab_size,
            shard_schema.teacher_ids_column(i): meta.teachers[i].vocab_size,
        }
        top = hi.get(col, int(r[shard_schema.teacher_n_chunks_column(i)]))
        lo = 0 if col in hi else -1
        r[col] = r[col].copy()
        r[col][rng.integers(len(r[col]))] = rng.choice([lo - 1, lo, top - 1, top, 2**31 - 1])


def test_check_batch_agrees_with_a_per_element_reference():
    """Random batches (empty lists included), each with one random edit, whole or sliced (list
    offsets not starting at 0, as in a table slice): check_batch raises exactly when the dense
    reference finds a bad value, at the same row and column."""
    rng = np.random.default_rng(0)
    meta = shard_schema.ShardMeta(shard_schema.SCHEMA_VERSION, STUDENT, TEACHERS)
    schema = shard_schema.shard_schema(STUDENT, TEACHERS)
    raised = 0
    for trial in range(120):
        rows = [_row(trial, w, int(rng.integers(0, 6)), [int(rng.integers(0, 6)), 3])
                for w in range(int(rng.integers(1, 7)))]  # fmt: skip
        _damage(rows, rng, meta)
        k = int(rng.integers(len(rows)))
        batch = shards.rows_to_batch(rows, schema).slice(k)
        expected = _first_bad(rows[k:], meta)
        try:
            value_checks.check_batch(batch, meta, where="f.arrow", first_row=k)
            found = None
        except value_checks.BadValueError as e:
            found, raised = (e.row - k, e.column), raised + 1
        assert found == expected, (trial, rows[k:])
    assert 20 < raised < 110  # both outcomes were exercised, often


def _first_bad_cached(row, vocab: int) -> str | None:
    """The dense reference of `value_checks.check_cached_row`: the column of the first bad value."""
    if any(not -1 <= int(v) < vocab for v in row.topk_ids.ravel()):
        return "topk_ids"
    for column in ("topk_logprobs", "tail_logprob", "target_logprob"):
        x = getattr(row, column)
        if x is not None and any(v != v or v == float("inf") for v in x.ravel().tolist()):
            return column
    return None


def test_cached_row_check_agrees_with_a_per_element_reference():
    """Teacher-cache rows (the real `CachedRow`) with one random edit each: out-of-vocabulary or
    below -1 ids, NaN or +inf log-probs (and harmless ones: -1, vocab - 1, -inf)."""
    from tokenbridge.formats.teacher_cache_reader import CachedRow

    rng = np.random.default_rng(1)
    vocab, raised = 300, 0
    for trial in range(200):
        u, k = int(rng.integers(0, 5)), 4
        row = CachedRow(
            rng.integers(-1, vocab, (u, k)),
            np.log(rng.random((u, k))).astype(np.float32),
            np.log(rng.random(u)).astype(np.float32),
            None if trial % 3 == 0 else np.log(rng.random(u)).astype(np.float32),
        )
        column = str(rng.choice(["topk_ids", "topk_logprobs", "tail_logprob", "target_logprob"]))
        x = getattr(row, column)
        if x is not None and x.size:
            bad = [-2, -1, vocab - 1, vocab, 2**17] if column == "topk_ids" else [
                np.nan, np.inf, -np.inf, 0.0]  # fmt: skip
            x.ravel()[rng.integers(x.size)] = rng.choice(bad)
        expected = _first_bad_cached(row, vocab)
        try:
            value_checks.check_cached_row(row, vocab_size=vocab, where="cache-0.arrow", row=7)
            found = None
        except value_checks.BadValueError as e:
            assert str(e).startswith(f"cache-0.arrow row 7 column {e.column}: ")
            assert "re-run the teacher-cache job" in str(e)
            found, raised = e.column, raised + 1
        assert found == expected, (trial, column, x)
    assert 30 < raised < 190


def test_the_trainer_refuses_a_cached_id_outside_the_teacher_vocabulary(tmp_path):
    """`CachedTeacher.read` checks each row it hands on: a real cache whose ids reach 299, read
    for a teacher of 200 tokens, names the cache file, the row and the column."""
    from tests.unit import test_teacher_cache_format
    from tokenbridge.formats import teacher_cache_reader
    from tokenbridge.teacher.outputs import TeacherOutputSpec
    from trainer.teacher.cached_teacher import CachedTeacher

    ss = test_teacher_cache_format._shards(tmp_path / "shards", [[5, 3], [4]])
    cs = teacher_cache_reader.open_cache(
        test_teacher_cache_format._cache(
            tmp_path / "cache", ss, test_teacher_cache_format._meta(ss)
        ),
        test_teacher_cache_format._expect(ss),
    )
    CachedTeacher(
        cs, TeacherOutputSpec(300, topk=test_teacher_cache_format.K), index=0, device="cpu"
    ).read([0], [5], 8)
    small = CachedTeacher(
        cs, TeacherOutputSpec(200, topk=test_teacher_cache_format.K), index=0, device="cpu"
    )
    with pytest.raises(
        value_checks.BadValueError, match=r"row \d+ column topk_ids: id 2\d\d at "
    ) as e:
        small.read([0], [5], 8)
    assert str(cs.files[0]) in str(e.value) and "outside [-1, 200)" in str(e.value)
