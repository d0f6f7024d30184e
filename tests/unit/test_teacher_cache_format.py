"""The teacher cache's format and reader: packed ids, log-prob codecs, the batch cutter, and
`open_cache` refusing every mismatch before a trainer reads a row (hand-made caches written with
the job's own row writer, `dofns.to_record_batch`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipelines.teacher_cache import job, score_dofns
from pipelines.teacher_cache.handler import RowBatch, ScoredBatch
from tokenbridge.formats import checksums, shard_schema, shards, teacher_cache, teacher_cache_reader
from tokenbridge.formats.fingerprints import shards_fingerprint
from tokenbridge.teacher.outputs import TeacherOutputSpec
from trainer.teacher.cached_teacher import CachedTeacher, check_spec

STUDENT = shard_schema.TokenizerInfo("student", "a" * 64, 100)
TEACHER = shard_schema.TokenizerInfo("teacher", "b" * 64, 300)
K = 4


@pytest.mark.parametrize("bits", [1, 7, 8, 13, 16, 18, 24, 25, 30, 32])
def test_packed_ids_round_trip(bits):
    rng = np.random.default_rng(bits)
    ids = rng.integers(0, 1 << bits, 1001, dtype=np.int64)
    ids[:2] = [0, (1 << bits) - 1]
    buf = teacher_cache.pack_ids(ids, bits)
    assert len(buf) == -(-ids.size * bits // 8)
    assert np.array_equal(teacher_cache.unpack_ids(buf, bits, ids.size), ids)
    with pytest.raises(ValueError, match="outside"):
        teacher_cache.pack_ids(np.array([1 << bits]), bits)


def test_id_width_follows_the_vocabulary():
    assert (
        teacher_cache.id_bits(262_144) == 18
        and teacher_cache.id_bits(49_152) == 16
        and teacher_cache.id_bits(2) == 1
    )
    ids = np.array([0, 513, 49_151])
    assert teacher_cache.pack_ids(ids, 16) == ids.astype("<u2").tobytes()  # 16 bits: plain uint16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_logprob_codecs_round_like_torch(dtype):
    x = np.array([0.0, -1e-7, -0.3, -2.5, -17.123, -60000.0, -np.inf], np.float32)
    x = np.concatenate([x, -np.random.default_rng(0).exponential(5, 500).astype(np.float32)])
    got = teacher_cache.decode_logprobs(teacher_cache.encode_logprobs(x, dtype), dtype)
    want = torch.from_numpy(x).to(getattr(torch, dtype)).float().numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_cut_batches_bounds_padded_tokens_and_rows():
    lengths = np.array([5, 64, 30, 31, 2, 64, 100, 7, 8, 9])
    groups = score_dofns.cut_batches(lengths, budget=128, max_rows=3)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
    for g in groups:
        assert len(g) <= 3 and (len(g) == 1 or len(g) * lengths[g].max() <= 128)
    assert [6] in [g.tolist() for g in groups]  # longer than the budget: alone


# --- hand-made shard and cache directories --------------------------------------------------


def _shards(tmp_path, lengths: list[list[int]]):
    tmp_path.mkdir(parents=True)
    schema = shard_schema.shard_schema(STUDENT, [TEACHER])
    files = {}
    for f, rows in enumerate(lengths):
        name = shards.shard_name(f, len(lengths))
        out = []
        for r, n in enumerate(rows):
            out.append({
                "doc_id": f"d{f}", "window": r, "char_start": 0, "char_end": 1, "text": "x",
                "student_ids": np.arange(n, dtype=np.int32),
                shard_schema.teacher_ids_column(0): np.arange(n, dtype=np.int32) % 300,
                shard_schema.teacher_chunk_column(0): np.arange(n, dtype=np.int32),
                shard_schema.teacher_student_chunk_column(0): np.arange(n, dtype=np.int32),
                shard_schema.teacher_n_chunks_column(0): n,
            })  # fmt: skip
        with shards.ShardWriter(tmp_path / name, schema) as w:
            w.write_rows(out)
        files[name] = len(out)
    shards.write_completed(tmp_path, {"student": STUDENT.to_json()}, files=files)
    return shards.open_shards(tmp_path)


def _meta(shard_set, **kw) -> teacher_cache.CacheMeta:
    teacher = {"name": "t", "weights": "w1", "tokenizer": TEACHER.fingerprint,
               "vocab_size": TEACHER.vocab_size, "dtype": "float32"}  # fmt: skip
    files = {p.name: int(n) for p, n in zip(shard_set.files, shard_set.file_rows)}
    sh = {"fingerprint": shards_fingerprint(shard_set), "teacher_index": 0, "files": files}
    return teacher_cache.CacheMeta(teacher=teacher, shards=sh, k=K, temperature=1.0, **kw)


def _values(name: str, row: int, u: int):
    """Deterministic outputs of one row: ids descending from 299, the last slot empty."""
    rng = np.random.default_rng(hash((name, row)) % 2**32)
    lp = np.sort(-rng.exponential(3, (u, K)).astype(np.float32), axis=1)[:, ::-1].copy()
    lp[:, -1] = -np.inf
    ids = (299 - np.arange(u * K) % 300).reshape(u, K)
    return ids, lp, np.log(rng.uniform(0.01, 0.5, u)).astype(np.float32), -rng.exponential(2, u)


def _cache(tmp_path, shard_set, meta, *, skip=(), complete=True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    schema, files = meta.schema(), {}
    name = teacher_cache.cache_name(0, 1)
    with shards.ShardWriter(tmp_path / name, schema) as w:
        for path, n in reversed(list(zip(shard_set.files, shard_set.file_rows))):  # any order
            rows = [r for r in range(n) if (path.name, r) not in skip]
            lens = [_lengths(shard_set, path)[r] for r in rows]
            u = max(lens)
            out = {k: np.zeros((len(rows), u, K)) for k in ("topk_ids", "topk_logprobs")}
            out["tail_logprob"], out["target_logprob"] = np.zeros((2, len(rows), u))
            for i, (r, n_r) in enumerate(zip(rows, lens)):
                a, b, c, d = _values(path.name, r, n_r)
                out["topk_ids"][i, :n_r], out["topk_logprobs"][i, :n_r] = a, b
                out["tail_logprob"][i, :n_r], out["target_logprob"][i, :n_r] = c, d
            if meta.samples:  # R draws per position, sorted as the handler stores them
                out["sample_ids"] = np.sort(_draws(path.name, rows, u, meta.samples), axis=-1)
            ids = [np.zeros(n_r, np.int64) for n_r in lens]
            batch = RowBatch(path.name, np.asarray(rows, np.int32), ids)
            w.write_batch(score_dofns.to_record_batch(ScoredBatch(batch, out), meta, schema))
        files[name] = w.num_rows
    stats = {"kind": teacher_cache.KIND, "cache": meta.to_json(), "dead_letters": len(skip)}
    if complete:
        shards.write_completed(
            tmp_path, stats, files=files, schema_version=teacher_cache.CACHE_SCHEMA_VERSION
        )
    return tmp_path


def _draws(name: str, rows: list[int], u: int, r: int) -> np.ndarray:
    """[B, u, r] ids in [0, 300) per row, few distinct ones (so counts > 1 occur)."""
    return np.stack([np.random.default_rng([r, row, len(name)]).integers(0, 300, (u, r)) % 7 * 41
                     for row in rows])  # fmt: skip


def _lengths(shard_set, path) -> list[int]:
    col = shard_schema.teacher_ids_column(0)
    return [len(x) for b in shard_set.iter_batches(files=[path]) for x in b.column(col).to_pylist()]


def _expect(shard_set, **kw) -> teacher_cache_reader.Expected:
    base = {"tokenizer": TEACHER, "weights": "w1", "dtype": "float32", "where": "teachers[0].cache"}
    return teacher_cache_reader.Expected(shard_set, 0, **{**base, **kw})


def test_rows_come_back_by_shard_row_whatever_the_file_order(tmp_path):
    ss = _shards(tmp_path / "shards", [[5, 3, 7], [4, 6]])
    cs = teacher_cache_reader.open_cache(
        _cache(tmp_path / "cache", ss, _meta(ss, logprob_dtype="float32")), _expect(ss)
    )
    keys = [(p, r) for p, n in zip(ss.files, ss.file_rows) for r in range(n)]
    for g, (path, r) in enumerate(keys):
        ids, lp, tail, target = _values(path.name, r, _lengths(ss, path)[r])
        got = cs.read(g)
        assert np.array_equal(got.topk_logprobs, lp) and np.array_equal(got.tail_logprob, tail)
        assert np.array_equal(got.topk_ids, np.where(lp > -np.inf, ids, -1))
        assert np.allclose(got.target_logprob, target.astype(np.float32))
    # the trainer's source pads a microbatch with empty positions and keeps the row's values
    spec = TeacherOutputSpec(300, topk=K, target=True)
    out = CachedTeacher(cs, spec, index=0, device="cpu").read([3, 1], [4, 3], 8)
    assert out["topk_ids"].shape == (2, 8, K) and (out["topk_ids"][1, 3:] == -1).all()
    assert (
        torch.isneginf(out["topk_logprobs"][0, 4:]).all()
        and (out["tail_logprob"][0, 4:] == 0).all()
    )
    assert torch.equal(out["tail_logprob"][1, :3], torch.from_numpy(cs.read(1).tail_logprob))


def test_every_mismatch_is_refused_by_name(tmp_path):
    ss = _shards(tmp_path / "shards", [[5, 3], [4]])
    d = _cache(tmp_path / "cache", ss, _meta(ss))
    for kw, what in [({"weights": "w2"}, "teacher weights"), ({"dtype": "bfloat16"}, "teacher dtype"),
                     ({"tokenizer": STUDENT}, "tokenizer")]:  # fmt: skip
        with pytest.raises(
            teacher_cache_reader.CacheMismatchError, match=f"teachers\\[0\\].cache=.*{what}"
        ):
            teacher_cache_reader.open_cache(d, _expect(ss, **kw))
    other = _shards(tmp_path / "other", [[5, 3], [4, 2]])
    with pytest.raises(teacher_cache_reader.CacheMismatchError, match="other shards"):
        teacher_cache_reader.open_cache(d, _expect(other))
    with pytest.raises(teacher_cache_reader.CacheMismatchError, match="teacher column"):
        teacher_cache_reader.open_cache(d, dataclasses.replace(_expect(ss), teacher_index=1))


def test_incomplete_caches_are_refused(tmp_path):
    ss = _shards(tmp_path / "shards", [[5, 3], [4]])
    d = _cache(tmp_path / "nomarker", ss, _meta(ss), complete=False)
    with pytest.raises(teacher_cache_reader.IncompleteCacheError, match="no COMPLETED marker"):
        teacher_cache_reader.open_cache(d, _expect(ss))
    skip = {(ss.files[0].name, 1)}
    d = _cache(tmp_path / "dead", ss, _meta(ss), skip=skip)
    with pytest.raises(
        teacher_cache_reader.IncompleteCacheError, match=r"1 of 3 shard rows .* row 1\); .* 1 rows"
    ):
        teacher_cache_reader.open_cache(d, _expect(ss))


def test_the_cache_must_hold_what_the_loss_reads():
    m = teacher_cache.CacheMeta(
        teacher={"vocab_size": 300}, shards={}, k=8, temperature=2.0, target=False
    )
    ok = TeacherOutputSpec(300, topk=8, temperature=2.0)
    check_spec(m, ok, where="w", mode="xtoken")
    for spec, what in [
        (dataclasses.replace(ok, topk=16), "top-8, xtoken asks for k=16"),
        (dataclasses.replace(ok, temperature=1.0), "temperature 2.0"),
        (dataclasses.replace(ok, target=True), "target log-probs"),
        (TeacherOutputSpec(300, columns=5, target=True), "columns"),
    ]:
        with pytest.raises(teacher_cache_reader.CacheMismatchError, match=what):
            check_spec(m, spec, where="w", mode="xtoken")
    # a target-only spec (alm) ignores k and the temperature
    check_spec(
        dataclasses.replace(m, target=True),
        TeacherOutputSpec(300, target=True),
        where="w",
        mode="alm",
    )


def test_damaged_cache_files_are_refused_by_name(tmp_path):
    ss = _shards(tmp_path / "shards", [[5, 3], [4]])
    d = _cache(tmp_path / "cache", ss, _meta(ss))
    teacher_cache_reader.open_cache(d, _expect(ss))  # intact
    path = d / teacher_cache.cache_name(0, 1)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte inside the record batches
    path.write_bytes(bytes(raw))
    with pytest.raises(checksums.DamagedFileError, match=f"{path.name}: damaged: expected"):
        teacher_cache_reader.open_cache(d, _expect(ss))
    with pytest.raises(ValueError, match="verify='sometimes'"):
        teacher_cache_reader.open_cache(d, _expect(ss), verify="sometimes")


def test_sampled_ids_read_back_as_distinct_ids_with_counts(tmp_path):
    ss = _shards(tmp_path / "shards", [[5, 3], [4]])
    meta = _meta(ss, samples=6)
    cs = teacher_cache_reader.open_cache(_cache(tmp_path / "cache", ss, meta), _expect(ss))
    g = 0
    for path, n_rows in zip(ss.files, ss.file_rows):
        for r in range(n_rows):
            u = _lengths(ss, path)[r]
            n, ids, counts = cs.read_samples(g)
            draws = _draws(path.name, [r], u, 6)[0]
            assert n.shape == (u,) and counts.sum() == 6 * u
            at = 0
            for t in range(u):  # the dense reference: np.unique of each position's draws
                want_ids, want_counts = np.unique(draws[t], return_counts=True)
                assert np.array_equal(ids[at : at + n[t]], want_ids)
                assert np.array_equal(counts[at : at + n[t]], want_counts)
                at += n[t]
            g += 1
    plain = teacher_cache_reader.open_cache(_cache(tmp_path / "plain", ss, _meta(ss)), _expect(ss))
    with pytest.raises(ValueError, match="without sampled ids"):
        plain.read_samples(0)


def test_sampled_ids_are_refused_for_a_cross_tokenizer_teacher():
    job.check_samples(4, student=STUDENT, teacher=STUDENT)  # same tokenizer: sampled KD
    job.check_samples(0, student=STUDENT, teacher=TEACHER)  # no samples asked
    with pytest.raises(ValueError, match=r"--samples 4: .*\(teacher\) is not the student's"):
        job.check_samples(4, student=STUDENT, teacher=TEACHER)


def _kl(top, tail, q) -> float:
    p = np.concatenate([top, tail[:, None]], axis=1)
    return float(np.mean(np.sum(np.exp(p) * (p - q), axis=1)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("k", [2, 8, 32])
def test_stored_logprobs_move_the_kl_within_the_derived_bound(dtype, k):
    """The dense reference: KL(P || Q) over the k + 1 categories (top-k + exact tail) from fp32
    log-probs vs from the stored ones, against `kl_change_bound`, over peaked and flat P."""
    rng = np.random.default_rng(k)
    for scale in (0.3, 3.0, 12.0):  # flat to peaked teachers over a 1000-token vocabulary
        logits = rng.normal(0, scale, (64, 1000))
        logp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        ranked = np.sort(logp, axis=1)[:, ::-1]
        top = ranked[:, :k].astype(np.float32)
        tail = np.logaddexp.reduce(ranked[:, k:], axis=1)  # exact, as stored (fp32 suffices)
        q = np.log(rng.dirichlet(np.ones(k + 1), 64))  # a student over the same categories
        stored = teacher_cache.decode_logprobs(
            teacher_cache.encode_logprobs(top, dtype), dtype
        ).astype(np.float64)

        exact = _kl(top.astype(np.float64), tail, q)
        rounded = _kl(stored, tail, q)
        bound = teacher_cache.kl_change_bound(exact, max_abs_logprob=float(np.abs(top).max()), k=k,
                                   dtype=dtype)  # fmt: skip
        assert abs(rounded - exact) <= bound, (scale, rounded - exact, bound)
        assert bound < 0.5 * (1 + exact)  # not vacuous at these scales
