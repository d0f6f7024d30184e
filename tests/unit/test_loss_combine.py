"""KD + CE combination (fixed and dynamic) and several teachers: values, grads, split invariance."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_loss_refs import (
    dense_t2s_first,
    logits_for,
    make_pair,
    masked_logp,
    random_t2s,
    ref_ce,
    ref_xtoken,
)
from tokenbridge.losses import (
    AlmConfig,
    CombineConfig,
    MultiTeacherConfig,
    XTokenConfig,
    XTokenTables,
    adaptive_weights,
    alm,
    alm_teacher_spec,
    ce,
    collate_aligned,
    combine,
    combine_teachers,
    dynamic_scale,
    index_chunks,
    normalize,
    shift_targets,
    teacher_nll,
    teacher_outputs_from_logits,
    teacher_weights,
    xtoken,
    xtoken_teacher_spec,
)


def _kd_ce(pair, student, teacher, tables, *, chunk_size=4):
    cfg = XTokenConfig(k=4)
    tgt_t = shift_targets(pair.batch.teacher_ids, pair.batch.teacher_len)
    te = teacher_outputs_from_logits(
        teacher, spec=xtoken_teacher_spec(cfg, teacher_vocab_size=pair.vt), target_ids_BT=tgt_t
    )
    kd = xtoken(
        student,
        te,
        index_chunks(pair.batch),
        tables=tables,
        vocab_size=pair.vs,
        config=cfg,
        chunk_size=chunk_size,
    )
    tgt_s = shift_targets(pair.batch.student_ids, pair.batch.student_len)
    return kd, ce(student, tgt_s, vocab_size=pair.vs, chunk_size=chunk_size)


def _setup(seed):
    pair = make_pair(seed, B=4)
    student, teacher = logits_for(pair, seed + 10)
    ids, w = random_t2s(seed, Vt=pair.Vt, vs=pair.vs)
    return (
        pair,
        student,
        teacher,
        XTokenTables.from_arrays(ids, w, student_vocab_size=pair.vs),
        dense_t2s_first(ids, w, pair.Vs),
    )


def test_fixed_combination_reports_both_terms():
    pair, student, teacher, tables, W = _setup(0)
    kd_out, ce_out = _kd_ce(pair, student, teacher, tables)
    kd, c = normalize(kd_out, kd_out.count), normalize(ce_out, ce_out.count)
    loss, m = combine(kd, c, config=CombineConfig(kd_weight=0.7, ce_weight=0.3))
    kd_ref, n_kd = ref_xtoken(student, teacher, pair, W, k=4)
    ce_ref, n_ce = ref_ce(student, pair)
    ref = 0.7 * kd_ref / n_kd + 0.3 * ce_ref / n_ce
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["kd"].double(), (kd_ref / n_kd).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["ce"].double(), (ce_ref / n_ce).detach(), rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(loss, student)
    (gr,) = torch.autograd.grad(ref, student)
    torch.testing.assert_close(g, gr.float(), rtol=1e-5, atol=1e-6)


def test_dynamic_scaling_is_stopgrad_ratio_and_keeps_kd_visible():
    pair, student, teacher, tables, _ = _setup(1)
    kd_out, ce_out = _kd_ce(pair, student, teacher, tables)
    kd, c = normalize(kd_out, kd_out.count), normalize(ce_out, ce_out.count)
    loss, m = combine(kd, c, config=CombineConfig(mode="dynamic"))
    r = float((c / kd).detach())
    torch.testing.assert_close(
        m["kd_scale"].double(), torch.tensor(r, dtype=torch.float64), rtol=1e-6, atol=0
    )
    torch.testing.assert_close(loss.detach(), 2 * c.detach())  # |CE|/|KD| * KD + CE
    assert float(m["kd"]) != float(m["ce"])  # the raw KD stays in the metrics
    (g,) = torch.autograd.grad(loss, student, retain_graph=True)
    (g_kd,) = torch.autograd.grad(kd, student, retain_graph=True)
    (g_ce,) = torch.autograd.grad(c, student)
    torch.testing.assert_close(g, r * g_kd + g_ce, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["fixed", "dynamic"])
def test_combined_loss_is_microbatch_invariant(mode):
    pair, student, teacher, tables, _ = _setup(2)
    # the step's global values fix the dynamic scale before any backward (e.g. last step's)
    with torch.no_grad():
        kd_all, ce_all = _kd_ce(pair, student, teacher, tables)
        scale = dynamic_scale(normalize(ce_all, ce_all.count), normalize(kd_all, kd_all.count))
    cfg = CombineConfig(mode=mode, kd_weight=0.5, ce_weight=2.0)
    from tests.unit.test_loss_refs import sub_pair

    results = []
    for n in (1, 2, 4):
        student.grad = None
        parts = [sub_pair(pair, i * 4 // n, (i + 1) * 4 // n) for i in range(n)]
        outs = []
        for i, sp in enumerate(parts):
            b0 = i * 4 // n
            s = student[b0 : b0 + len(sp.rows), : sp.batch.student_ids.shape[1]]
            t = teacher[b0 : b0 + len(sp.rows), : sp.batch.teacher_ids.shape[1]]
            outs.append(_kd_ce(sp, s, t, tables, chunk_size=3))
        kd_count = sum(int(k.count) for k, _ in outs)  # all-reduced over the step
        ce_count = sum(int(c.count) for _, c in outs)
        total = 0.0
        for k, c in outs:
            loss, _ = combine(
                normalize(k, kd_count), normalize(c, ce_count), config=cfg, scale=scale
            )
            loss.backward()
            total += float(loss.detach())
        results.append((total, student.grad.clone()))
    for total, grad in results[1:]:
        assert abs(total - results[0][0]) < 1e-5
        torch.testing.assert_close(grad, results[0][1], rtol=1e-5, atol=1e-7)


def _two_teachers(seed):
    """Teacher 1 sees the text through a coarser tokenizer: every two chunks of teacher 0 merged."""
    pair = make_pair(seed, B=3)
    rows = []
    for r in pair.rows:
        r = dict(r)
        r["teacher1_ids"] = [(i * 7 + 3) % pair.vt for i in r["teacher0_ids"]]
        r["teacher1_chunk"] = [c // 2 if c >= 0 else -1 for c in r["teacher0_chunk"]]
        r["teacher1_student_chunk"] = [
            c // 2 if c >= 0 else -1 for c in r["teacher0_student_chunk"]
        ]
        r["teacher1_n_chunks"] = (r["teacher0_n_chunks"] + 1) // 2
        rows.append(r)
    return pair, rows


def test_two_teachers_static_and_adaptive_weights():
    pair, rows = _two_teachers(3)
    student, t0 = logits_for(pair, 4, scale=1.0)
    _, t1 = logits_for(pair, 5, scale=1.0)
    cfg = AlmConfig()
    kds, nlls = [], []
    for i, t in enumerate((t0, t1)):
        batch = collate_aligned(rows, i)
        idx = index_chunks(batch)
        spec = alm_teacher_spec(cfg, teacher_vocab_size=pair.vt)
        te = teacher_outputs_from_logits(
            t, spec=spec, target_ids_BT=shift_targets(batch.teacher_ids, batch.teacher_len)
        )
        out = alm(student, te, idx, vocab_size=pair.vs, config=cfg)
        kds.append(normalize(out, out.count))
        nlls.append(teacher_nll(te, idx)[0])
        # the NLL of the text under teacher i: every chunk token, by hand
        ref = 0.0
        for b, r in enumerate(rows):
            ids, ch = r[f"teacher{i}_ids"], r[f"teacher{i}_chunk"]
            ref -= sum(
                float(masked_logp(t[b, j - 1], pair.vt)[ids[j]])
                for j in range(1, len(ids))
                if ch[j] >= 0
            )
        assert abs(float(nlls[-1]) - ref) < 1e-4
    w = teacher_weights(MultiTeacherConfig(weights=(3.0, 1.0)), 2)
    total, m = combine_teachers(kds, w)
    torch.testing.assert_close(total, 0.75 * kds[0] + 0.25 * kds[1])
    assert set(m) == {"teacher0/kd", "teacher0/weight", "teacher1/kd", "teacher1/weight", "kd"}
    units = int((collate_aligned(rows, 0).student_chunk >= 0).sum())
    aw = teacher_weights(
        MultiTeacherConfig(adaptive=True, temperature=0.5),
        2,
        nll_sums_K=torch.stack(nlls),
        units=units,
    )
    per_unit = torch.stack(nlls) / units
    torch.testing.assert_close(aw, torch.softmax(-per_unit / 0.5, 0))
    assert int(aw.argmax()) == int(per_unit.argmin())  # the better teacher weighs more
    torch.testing.assert_close(
        adaptive_weights(torch.tensor([1.0, 1.0]), 4), torch.tensor([0.5, 0.5], dtype=torch.float64)
    )


def test_multi_teacher_config_validation():
    with pytest.raises(ValueError):
        MultiTeacherConfig(weights=(-1.0, 2.0))
    with pytest.raises(ValueError, match="adaptive"):
        teacher_weights(MultiTeacherConfig(adaptive=True), 2)
    with pytest.raises(ValueError, match="2 teacher weights for 3"):
        teacher_weights(MultiTeacherConfig(weights=(1.0, 1.0)), 3)
