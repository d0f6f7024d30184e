"""gold (exact-map KL + sorted-probability L1) against the dense reference."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_loss_refs import (
    assert_bf16_close,
    assert_empty_loss,
    assert_matches_ref,
    chunkless_batch,
    logits_for,
    make_pair,
    ref_gold,
    split_invariance,
)
from tokenbridge.losses import (
    GoldConfig,
    GoldTables,
    gold,
    gold_teacher_spec,
    index_chunks,
    shift_targets,
    teacher_outputs_from_logits,
)


def _exact_map(pair, seed, n_pairs=25):
    g = torch.Generator().manual_seed(seed)
    e = torch.full((pair.Vt,), -1, dtype=torch.int64)
    t = torch.randperm(pair.vt, generator=g)[:n_pairs]
    s = torch.randperm(pair.vs, generator=g)[:n_pairs]
    e[t] = s
    e[t[0]] = s[1]  # a student id claimed twice: the second claim is dropped
    e[pair.vt] = 0  # a padded teacher row: ignored
    return e


def _setup(seed, *, B=3, dtype=torch.float32, n_pairs=25, **kw):
    pair = make_pair(seed, B=B, **kw)
    student, teacher = logits_for(pair, seed + 200, dtype=dtype)
    tables = GoldTables.from_exact_map(
        _exact_map(pair, seed, n_pairs), teacher_vocab_size=pair.vt, student_vocab_size=pair.vs
    )
    return pair, student, teacher, tables


def _teacher(pair, teacher, tables, cfg):
    spec = gold_teacher_spec(cfg, tables, teacher_vocab_size=pair.vt)
    tgt = shift_targets(pair.batch.teacher_ids, pair.batch.teacher_len)
    return teacher_outputs_from_logits(teacher, spec=spec, target_ids_BT=tgt, columns=tables.t_ids)


def _run(pair, student, teacher, tables, cfg, chunk_size=4):
    te = _teacher(pair, teacher, tables, cfg)
    return gold(
        student,
        te,
        index_chunks(pair.batch),
        tables=tables,
        vocab_size=pair.vs,
        config=cfg,
        chunk_size=chunk_size,
    )


def test_tables_from_exact_map():
    pair = make_pair(0)
    e = _exact_map(pair, 0)
    tb = GoldTables.from_exact_map(e, teacher_vocab_size=pair.vt, student_vocab_size=pair.vs)
    assert tb.s_ids.unique().numel() == tb.s_ids.numel() == 24  # one duplicate claim dropped
    assert set(tb.s_unmatched.tolist()) == set(range(pair.vs)) - set(tb.s_ids.tolist())
    for t, s in zip(tb.t_ids.tolist(), tb.s_ids.tolist()):
        assert e[t] == s


def test_empty_exact_map_is_a_clear_error():
    with pytest.raises(ValueError, match="exact map is empty"):
        GoldTables.from_exact_map(
            torch.full((30,), -1), teacher_vocab_size=30, student_vocab_size=20
        )
    with pytest.raises(ValueError, match="exact map is empty"):  # pairs only beyond the vocab
        GoldTables.from_exact_map(
            torch.full((30,), 25), teacher_vocab_size=30, student_vocab_size=20
        )


@pytest.mark.parametrize(
    ("kind", "tau", "rest", "weights"),
    [
        ("forward", 1.0, True, None),
        ("reverse", 1.0, True, (0.6, 0.4)),
        ("jsd", 1.5, True, None),
        ("forward", 1.0, False, None),
        ("jsd", 1.0, False, (1.0, 1.0)),
    ],
)
def test_gold_matches_dense(kind, tau, rest, weights):
    pair, student, teacher, tables = _setup(1)
    mw, uw = (None, None) if weights is None else weights
    cfg = GoldConfig(
        divergence=kind,
        beta=0.3,
        temperature=tau,
        rest_bucket=rest,
        matched_weight=mw,
        unmatched_weight=uw,
    )
    out = _run(pair, student, teacher, tables, cfg)
    ref, n = ref_gold(
        student,
        teacher,
        pair,
        tables.t_ids.tolist(),
        tables.s_ids.tolist(),
        kind=kind,
        beta=0.3,
        tau=tau,
        rest_bucket=rest,
        weights=weights,
    )
    assert_matches_ref(out, ref, n, student)


def test_gold_truncated_uld_width_only_loses_the_unshipped_tail():
    pair, student, teacher, tables = _setup(2)
    exact = _run(pair, student, teacher, tables, GoldConfig())
    narrow = _run(pair, student, teacher, tables, GoldConfig(uld_width=3))
    a = float(exact.metrics["gold_unmatched_sum"])
    b = float(narrow.metrics["gold_unmatched_sum"])
    assert b >= a - 1e-6  # pairing the unshipped teacher mass with zeros can only add L1
    torch.testing.assert_close(
        narrow.metrics["gold_matched_sum"], exact.metrics["gold_matched_sum"]
    )


def test_gold_gradcheck_float64():
    pair, student, teacher, tables = _setup(
        3, B=2, vs=9, vt=11, max_chunks=3, dtype=torch.float64, n_pairs=5
    )
    idx = index_chunks(pair.batch)
    for cfg in (GoldConfig(), GoldConfig(divergence="jsd", rest_bucket=False)):
        te = _teacher(pair, teacher, tables, cfg)
        assert torch.autograd.gradcheck(
            lambda x, te=te, c=cfg: (
                gold(x, te, idx, tables=tables, vocab_size=pair.vs, config=c, chunk_size=3).sum
            ),
            (student,),
            fast_mode=True,
        )


def test_gold_empty_sides_all_masked_bf16():
    pair, student, teacher, tables = _setup(4, B=4, empty_side_prob=0.3, bos=False)
    out = _run(pair, student, teacher, tables, GoldConfig())
    ref, n = ref_gold(student, teacher, pair, tables.t_ids.tolist(), tables.s_ids.tolist())
    assert int(out.count) == n and int(out.metrics["chunks_empty_side"]) > 0
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    assert_bf16_close(lambda s, t: _run(pair, s, t, tables, GoldConfig()), student, teacher, ref)
    te = _teacher(pair, teacher, tables, GoldConfig())
    empty = gold(
        student,
        te,
        index_chunks(chunkless_batch(pair)),
        tables=tables,
        vocab_size=pair.vs,
        config=GoldConfig(),
    )
    assert_empty_loss(empty, student)


def test_gold_rejects_teacher_without_the_exact_columns():
    pair, student, teacher, tables = _setup(5)
    spec = gold_teacher_spec(GoldConfig(), tables, teacher_vocab_size=pair.vt)
    tgt = shift_targets(pair.batch.teacher_ids, pair.batch.teacher_len)
    from dataclasses import replace

    spec = replace(spec, columns=3, rest_sorted=2)
    te = teacher_outputs_from_logits(teacher, spec=spec, target_ids_BT=tgt, columns=torch.arange(3))
    with pytest.raises(ValueError, match="columns=tables.t_ids"):
        gold(
            student,
            te,
            index_chunks(pair.batch),
            tables=tables,
            vocab_size=pair.vs,
            config=GoldConfig(),
        )


def test_gold_microbatch_split_invariance():
    pair, student, teacher, tables = _setup(6, B=4)
    cfg = GoldConfig(divergence="jsd")
    split_invariance(
        pair, student, teacher, lambda sp, s, t: _run(sp, s, t, tables, cfg, chunk_size=3)
    )
