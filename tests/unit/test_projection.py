"""Sparse projections on real tokenizer pairs, checked against a per-token Python reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tokenbridge import projection
from tokenbridge.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def pair(teacher_dir, student_dir):
    """Gemma-3 (teacher) x SmolLM2 (student) with lm_head rows from the model dirs."""
    t, s = load_tokenizer(teacher_dir), load_tokenizer(student_dir)
    p = projection.build_projection(
        t,
        s,
        k=8,
        teacher_rows=projection.model_rows(teacher_dir),
        student_rows=projection.model_rows(student_dir),
    )
    return t, s, p


def _reference_row(src_bytes: bytes, dst, dst_index: dict[bytes, int], k: int):
    """The documented method, one token at a time: (ids, weights) or None for an empty row."""
    if src_bytes in dst_index:
        return [dst_index[src_bytes]], [1.0]
    seq = []
    text = src_bytes.decode("utf-8", errors="surrogateescape")
    run = ""
    for ch in text + "\0end":
        if "\udc80" <= ch <= "\udcff" or ch == "\0":
            if run:
                seq += dst.encode(run).ids.tolist()
                run = ""
            if ch == "\0":
                break
            single = dst_index.get(bytes([ord(ch) - 0xDC00]))
            if single is None:
                return None
            seq.append(single)
        else:
            run += ch
    seq = [i for i in seq if i not in dst.all_special_ids]
    if not seq:
        return None
    weights: dict[int, float] = {}
    first: dict[int, int] = {}
    for j, i in enumerate(seq):
        weights[i] = weights.get(i, 0.0) + 0.5**j
        first.setdefault(i, j)
    top = sorted(weights, key=lambda i: (-weights[i], first[i]))[:k]
    total = sum(weights[i] for i in top)
    return top, [weights[i] / total for i in top]


def _check_row(ids_row, w_row, ref):
    if ref is None:
        assert (ids_row == -1).all() and (w_row == 0).all()
        return
    ids, ws = ref
    assert ids_row[: len(ids)].tolist() == ids
    np.testing.assert_allclose(w_row[: len(ids)], ws, rtol=1e-6)
    assert (ids_row[len(ids) :] == -1).all() and (w_row[len(ids) :] == 0).all()


def test_exact_map_is_complete_and_byte_identical(pair):
    t, s, p = pair
    tb, sb = t.token_bytes(), s.token_bytes()
    s_set = {b for i, b in enumerate(sb) if b and i not in s.all_special_ids}
    for i, b in enumerate(tb):
        j = int(p.exact_t2s[i])
        if j >= 0:
            assert sb[j] == b
        elif b and i not in t.all_special_ids:
            assert b not in s_set, (i, b)
    t_idx, s_idx = p.exact_pairs()
    assert len(t_idx) > 40_000  # the design notes measured ~46k byte-identical pairs
    assert all(tb[a] == sb[b] for a, b in zip(t_idx.tolist(), s_idx.tolist()))
    assert len(set(s_idx.tolist())) == len(s_idx)  # one-to-one


def test_exact_rows_are_one_hot(pair):
    _, _, p = pair
    for ids, w, exact in (
        (p.t2s_ids, p.t2s_weights, p.exact_t2s),
        (p.s2t_ids, p.s2t_weights, p.exact_s2t),
    ):
        hit = exact >= 0
        assert (ids[hit, 0] == exact[hit]).all()
        assert (w[hit, 0] == 1.0).all() and (w[hit, 1:] == 0).all() and (ids[hit, 1:] == -1).all()


def test_rows_sum_to_one_and_are_left_packed(pair):
    _, s, p = pair
    for ids, w, dst_rows in (
        (p.t2s_ids, p.t2s_weights, s.vocab_size),
        (p.s2t_ids, p.s2t_weights, None),
    ):
        full = ids[:, 0] >= 0
        np.testing.assert_allclose(w[full].sum(1), 1.0, rtol=1e-5)
        assert (w[~full] == 0).all() and (ids[~full] == -1).all()
        assert ((ids >= 0) == (w > 0)).all()
        assert (np.diff((ids >= 0).astype(int), axis=1) <= 0).all()  # no gap before a filled slot
        assert (np.diff(w, axis=1) <= 1e-7).all()  # heaviest first
        if dst_rows is not None:
            assert ids.max() < dst_rows
    assert int(p.meta["t2s_empty_rows"]) == int((p.t2s_ids[:, 0] < 0).sum())


def test_rows_match_the_per_token_reference(pair):
    t, s, p = pair
    tb, sb = t.token_bytes(), s.token_bytes()
    s_index = projection.exact_index(s, sb)
    t_index = projection.exact_index(t, tb)
    rng = np.random.default_rng(0)
    t_rows = [i for i in rng.choice(len(tb), 300, replace=False) if tb[i]]
    for i in t_rows:
        if i not in t.all_special_ids:
            _check_row(p.t2s_ids[i], p.t2s_weights[i], _reference_row(tb[i], s, s_index, 8))
    # every student token whose bytes are not UTF-8 alone (byte-level fragments)
    invalid = []
    for i, b in enumerate(sb):
        if b and i not in s.all_special_ids:
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                invalid.append(i)
    assert len(invalid) > 50
    for i in invalid + rng.choice(len(sb), 300, replace=False).tolist():
        if sb[i] and i not in s.all_special_ids:
            _check_row(p.s2t_ids[i], p.s2t_weights[i], _reference_row(sb[i], t, t_index, 8))


def test_specials_pair_by_role(pair):
    t, s, p = pair
    for role in ("bos", "eos"):
        a, b = t.special_ids[role], s.special_ids[role]
        assert p.t2s_ids[a, 0] == b and p.t2s_weights[a, 0] == 1.0
        assert p.s2t_ids[b, 0] == a and p.s2t_weights[b, 0] == 1.0
    roled = set(t.special_ids.values())
    other = [i for i in t.all_special_ids if i not in roled]
    assert other and (p.t2s_ids[other] == -1).all()


def test_save_load_roundtrip_and_refusals(pair, tmp_path):
    t, s, p = pair
    path = projection.save_projection(p, tmp_path / "p.safetensors")
    q = projection.load_projection(path, teacher=t.info(), student=s.info())
    for name in projection.TENSORS:
        np.testing.assert_array_equal(getattr(q, name), getattr(p, name))
    assert q.meta == p.meta and q.meta["teacher_fingerprint"] == t.fingerprint
    with pytest.raises(projection.ProjectionMismatchError, match="rebuild"):
        projection.load_projection(path, teacher=s.info(), student=s.info())
    with pytest.raises(projection.ProjectionMismatchError, match="student"):
        projection.load_projection(path, student=t.info())
    # an exact map that pairs (almost) nothing is a broken build, refused on load
    broken = dataclasses.replace(
        p, exact_t2s=np.full_like(p.exact_t2s, -1), exact_s2t=np.full_like(p.exact_s2t, -1)
    )
    bpath = projection.save_projection(broken, tmp_path / "broken.safetensors")
    with pytest.raises(projection.ProjectionCoverageError, match="exact map"):
        projection.load_projection(bpath)
    assert projection.load_projection(bpath, min_exact_coverage=0.0).exact_pairs()[0].size == 0


def test_malformed_files_are_refused(tmp_path):
    from safetensors.numpy import save_file

    with pytest.raises(FileNotFoundError, match="make projection"):
        projection.load_projection(tmp_path / "none.safetensors")
    save_file({"t2s_ids": np.zeros((2, 2), np.int32)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(projection.ProjectionMismatchError, match="missing tensors"):
        projection.load_projection(tmp_path / "x.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes()[:20])
    with pytest.raises(
        projection.ProjectionMismatchError, match=r"cut.safetensors: damaged.*make proj"
    ):
        projection.load_projection(
            tmp_path / "cut.safetensors"
        )  # refused by name, not a Rust panic


def test_padded_rows_and_model_rows(vocab_fixture, teacher_dir, student_dir):
    assert (
        projection.model_rows(teacher_dir) == 262_144
        and projection.model_rows(student_dir) == 49_152
    )
    assert projection.model_rows(vocab_fixture("gpt-2")) is None
    t, s = load_tokenizer(vocab_fixture("phi-3")), load_tokenizer(vocab_fixture("gpt-2"))
    p = projection.build_projection(
        t, s, k=4, teacher_rows=t.vocab_size + 16, student_rows=s.vocab_size + 7
    )
    assert p.t2s_ids.shape == (t.vocab_size + 16, 4) and p.exact_s2t.shape == (s.vocab_size + 7,)
    for ids, w, ex, n in (
        (p.t2s_ids, p.t2s_weights, p.exact_t2s, t.vocab_size),
        (p.s2t_ids, p.s2t_weights, p.exact_s2t, s.vocab_size),
    ):
        assert (ids[n:] == -1).all() and (w[n:] == 0).all() and (ex[n:] == -1).all()
    assert p.meta["t2s_padded_rows"] == "16" and p.meta["s2t_padded_rows"] == "7"
    # ids point inside the other side's rows, never into its padding
    assert p.t2s_ids.max() < s.vocab_size and p.s2t_ids.max() < t.vocab_size
    with pytest.raises(ValueError, match="lm_head rows"):
        projection.build_projection(t, s, teacher_rows=t.vocab_size - 1)
    with pytest.raises(ValueError, match="k must be"):
        projection.build_projection(t, s, k=0)
