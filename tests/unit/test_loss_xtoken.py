"""xtoken against the dense reference (full softmax, dense projection matrix, loops over chunks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.test_loss_refs import (
    assert_bf16_close,
    assert_empty_loss,
    assert_matches_ref,
    assert_same_grad,
    chunkless_batch,
    chunks_of,
    dense_t2s,
    dense_t2s_first,
    logits_for,
    make_pair,
    random_key,
    random_t2s,
    ref_xtoken,
    split_invariance,
)
from tokenbridge.losses import (
    XTokenConfig,
    XTokenTables,
    index_chunks,
    shift_targets,
    teacher_outputs_from_logits,
    xtoken,
    xtoken_teacher_spec,
)
from tokenbridge.losses.ops.xtoken_tables import bucket_keys


def _setup(seed, *, B=3, dtype=torch.float32, first_only=False, **kw):
    pair = make_pair(seed, B=B, **kw)
    student, teacher = logits_for(pair, seed + 100, dtype=dtype)
    ids, w = random_t2s(seed, Vt=pair.Vt, vs=pair.vs)
    w[5:8] *= 3.0  # rows summing to > 1 are scaled back to 1
    tables = XTokenTables.from_arrays(ids, w, student_vocab_size=pair.vs, first_only=first_only)
    W = (dense_t2s_first if first_only else dense_t2s)(ids, w, pair.Vs)
    return pair, student, teacher, tables, W


def _teacher(pair, teacher, cfg):
    spec = xtoken_teacher_spec(cfg, teacher_vocab_size=pair.vt)
    tgt = shift_targets(pair.batch.teacher_ids, pair.batch.teacher_len)
    return teacher_outputs_from_logits(teacher, spec=spec, target_ids_BT=tgt)


def _run(pair, student, teacher, tables, cfg, chunk_size=4):
    return xtoken(
        student,
        _teacher(pair, teacher, cfg),
        index_chunks(pair.batch),
        tables=tables,
        vocab_size=pair.vs,
        config=cfg,
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize(
    ("kind", "tau", "k", "first_only"),
    [
        ("forward", 1.0, 4, True),
        ("forward", 1.0, 4, False),
        ("reverse", 1.0, 6, False),
        ("jsd", 2.0, 4, True),
        ("forward", 0.5, 60, False),
    ],
)
def test_xtoken_matches_dense(kind, tau, k, first_only):
    pair, student, teacher, tables, W = _setup(0, first_only=first_only)
    cfg = XTokenConfig(k=k, divergence=kind, beta=0.4, temperature=tau)
    out = _run(pair, student, teacher, tables, cfg)
    ref, n = ref_xtoken(student, teacher, pair, W, k=k, kind=kind, beta=0.4, tau=tau)
    assert_matches_ref(out, ref, n, student)


def test_xtoken_rest_bucket_makes_each_term_a_divergence():
    """Teacher == student distributions through an identity projection: every term is 0."""
    pair = make_pair(1, B=2, vs=30, vt=30, pad_cols=(0, 0))
    logits, _ = logits_for(pair, 7)
    ident = XTokenTables.from_arrays(
        torch.arange(30)[:, None], torch.ones(30, 1), student_vocab_size=30
    )
    # the teacher sees the same text with the same ids and the same logits
    rows = [
        dict(r, teacher0_ids=r["student_ids"], teacher0_chunk=r["teacher0_student_chunk"])
        for r in pair.rows
    ]
    for r in rows:  # make every chunk 1:1 on both sides
        n = sum(1 for c in r["teacher0_student_chunk"] if c >= 0)
        r["teacher0_student_chunk"] = [-1] + list(range(n)) + [-1]
        r["teacher0_chunk"] = r["teacher0_student_chunk"]
        r["teacher0_n_chunks"] = n
    from tokenbridge.losses import collate_aligned

    batch = collate_aligned(rows, 0)
    cfg = XTokenConfig(k=5)
    spec = xtoken_teacher_spec(cfg, teacher_vocab_size=30)
    te = teacher_outputs_from_logits(logits.detach(), spec=spec)
    out = xtoken(logits, te, index_chunks(batch), tables=ident, vocab_size=30, config=cfg)
    assert int(out.count) > 0
    assert abs(float(out.sum.detach())) < 1e-5
    assert float(out.metrics["teacher_rest_mass_sum"]) > 0  # the tail is a real bucket


def test_xtoken_gradcheck_float64():
    pair, student, teacher, tables, _ = _setup(
        2, B=2, vs=8, vt=10, max_chunks=3, dtype=torch.float64
    )
    idx = index_chunks(pair.batch)
    for kind in ("forward", "jsd"):
        cfg = XTokenConfig(k=3, divergence=kind)
        te = _teacher(pair, teacher, cfg)
        assert torch.autograd.gradcheck(
            lambda x, te=te, c=cfg: (
                xtoken(x, te, idx, tables=tables, vocab_size=pair.vs, config=c, chunk_size=3).sum
            ),
            (student,),
            fast_mode=True,
        )


def test_xtoken_chain_term_on_multi_token_chunks_only():
    pair, student, teacher, tables, W = _setup(3, B=3)
    cfg = XTokenConfig(k=4, chain_weight=0.5)
    out = _run(pair, student, teacher, tables, cfg)
    base, _ = ref_xtoken(student, teacher, pair, W, k=4)
    multi = [
        (b, sp, tp)
        for b, sp, tp in chunks_of(pair)
        if sp and tp and sp[0] > 0 and tp[0] > 0 and (len(sp) > 1 or len(tp) > 1)
    ]
    assert multi
    # the reference ALM over a pair restricted to multi-token chunks: rebuild it chunk by chunk
    chain = 0.0
    from tests.unit.test_loss_refs import chain as chain_lp
    from tests.unit.test_loss_refs import ref_bin

    for b, sp, tp in multi:
        ls = chain_lp(student[b], pair.rows[b]["student_ids"], sp, pair.vs)
        lt = chain_lp(teacher[b], pair.rows[b]["teacher0_ids"], tp, pair.vt)
        chain = chain + ref_bin(lt, ls, "kl")
    ref = base + 0.5 * chain
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    assert int(out.metrics["chunks_multi_token"]) == len(multi)
    assert_same_grad(out.sum, ref, student)


def test_xtoken_empty_sides_unpredicted_chunks_and_all_masked():
    pair, student, teacher, tables, W = _setup(4, B=4, empty_side_prob=0.3, bos=False)
    cfg = XTokenConfig(k=4)
    out = _run(pair, student, teacher, tables, cfg)
    ref, n = ref_xtoken(student, teacher, pair, W, k=4)
    assert int(out.count) == n
    assert int(out.metrics["chunks_empty_side"]) > 0
    assert int(out.metrics["chunks_unpredicted"]) > 0  # no BOS: chunk 0 starts at position 0
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    # a batch with no chunk at all: zero sum, zero count, a usable zero gradient
    out = xtoken(
        student,
        _teacher(pair, teacher, cfg),
        index_chunks(chunkless_batch(pair)),
        tables=tables,
        vocab_size=pair.vs,
        config=cfg,
    )
    assert_empty_loss(out, student)


def test_xtoken_bf16_and_neg_inf_student_logits():
    pair, student, teacher, tables, W = _setup(5)
    with torch.no_grad():  # columns no projection row can reach: q = 0 there, p = 0 too
        reach = W[:, : pair.vs].sum(0) > 0
        dead = (~reach).nonzero().squeeze(1)[:2]
        student[..., dead] = float("-inf")
    cfg = XTokenConfig(k=4)
    out = _run(pair, student, teacher, tables, cfg)
    ref, _ = ref_xtoken(student, teacher, pair, W, k=4)
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    out.sum.backward()
    assert torch.isfinite(student.grad).all()
    assert_bf16_close(lambda s, t: _run(pair, s, t, tables, cfg), student, teacher, ref)


def test_xtoken_microbatch_split_invariance():
    pair, student, teacher, tables, _ = _setup(6, B=4)
    cfg = XTokenConfig(k=5, divergence="jsd", chain_weight=0.3)
    split_invariance(
        pair, student, teacher, lambda sp, s, t: _run(sp, s, t, tables, cfg, chunk_size=3)
    )


def test_projection_table_validation():
    with pytest.raises(ValueError, match="student vocab_size"):
        XTokenTables.from_arrays(torch.tensor([[0, 50]]), torch.ones(1, 2), student_vocab_size=10)
    with pytest.raises(ValueError, match=">= 0"):
        XTokenTables.from_arrays(torch.tensor([[0]]), -torch.ones(1, 1), student_vocab_size=10)
    ids, w = torch.tensor([[1, 2, -1], [4, 3, 2]]), torch.tensor([[3.0, 1.0, 5.0], [0.1, 0.4, 0.2]])
    t = XTokenTables.from_arrays(ids, w, student_vocab_size=10, first_only=False)
    torch.testing.assert_close(t.t2s_weights[0], torch.tensor([0.75, 0.25, 0.0]))
    t = XTokenTables.from_arrays(ids, w, student_vocab_size=10)  # the heaviest slot, weight 1
    assert t.t2s_ids.tolist() == [[1], [3]] and t.t2s_weights.tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize(("kind", "first_only"), [("forward", True), ("jsd", False)])
def test_xtoken_buckets_match_dense(kind, first_only):
    pair = make_pair(7, B=3)
    student, teacher = logits_for(pair, 8)
    ids, w = random_t2s(7, Vt=pair.Vt, vs=pair.vs)
    key = random_key(7, pair.vs, pair.Vs)
    tables = XTokenTables.from_arrays(
        ids, w, student_vocab_size=pair.vs, first_only=first_only, s_key=key
    )
    W0 = (dense_t2s_first if first_only else dense_t2s)(ids, w, pair.Vs)
    W = torch.zeros_like(W0).index_add(1, key, W0)  # teacher slots land in their bucket
    cfg = XTokenConfig(k=5, divergence=kind)
    out = _run(pair, student, teacher, tables, cfg)
    ref, n = ref_xtoken(student, teacher, pair, W, k=5, kind=kind, key=key)
    assert_matches_ref(out, ref, n, student)


class _Proj:
    """A hand-made projection: student [" p", " pears", " person", "x", "e"], teacher
    [" p", "ears", "x", " per"]; " pears" -> " p" + "ears", " person" -> " per" + "son"."""

    s2t_ids = np.array([[0, -1], [0, 1], [3, -1], [2, -1], [1, -1]])
    s2t_weights = np.array([[1.0, 0], [0.67, 0.33], [1.0, 0], [1.0, 0], [1.0, 0]])
    t2s_ids = np.array([[0, -1], [4, 3], [3, -1], [0, 4]])
    t2s_weights = np.array([[1.0, 0], [0.67, 0.33], [1.0, 0], [0.67, 0.33]])


def test_bucket_keys_pool_student_tokens_a_finer_teacher_cannot_tell_apart():
    tables = XTokenTables.from_projection(_Proj(), student_vocab_size=5)
    # " pears" -> f = " p" -> g = " p"; " person" -> " per" -> " p": one bucket " p"
    assert tables.s_key.tolist() == [0, 0, 0, 3, 4]
    assert tables.t2s_ids[:, 0].tolist() == [0, 4, 3, 0]  # teacher " per" lands in " p" too
    plain = XTokenTables.from_projection(_Proj(), student_vocab_size=5, coarsen=False)
    assert plain.s_key is None and plain.t2s_ids[:, 0].tolist() == [0, 4, 3, 0]


def test_bucket_keys_break_two_cycles_and_reject_bad_maps():
    f = np.array([0, 1, 2])  # student 0 and 1 are byte-identical: each maps to the other
    g = np.array([1, 0, 2])
    assert bucket_keys(f, g).tolist() == [0, 0, 2]
    with pytest.raises(ValueError, match="idempotent"):
        XTokenTables.from_arrays(
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            student_vocab_size=3,
            s_key=torch.tensor([1, 2, 2]),
        )
