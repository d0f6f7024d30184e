"""The vocab-parallel code path of every mode, on a real one-process gloo group.

With a ``tp_group`` the modes compose `tokenbridge.dist_ops`'s vp_* ops (through `vocab_ops`)
instead of the fused single-device Functions. A group of world size 1 runs that exact code path
(the ops' collectives are real, over one rank), so its values and gradients must equal the
tp_group=None results. Multi-rank TP/CP/DP layouts are covered by the distributed test harness.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_loss_refs import logits_for, make_pair, random_key, random_t2s
from tokenbridge.losses import (
    AlmConfig,
    GoldConfig,
    GoldTables,
    KDTopKConfig,
    XTokenConfig,
    XTokenTables,
    alm,
    alm_teacher_spec,
    ce,
    gold,
    gold_teacher_spec,
    index_chunks,
    kd_topk,
    kd_topk_teacher_spec,
    shift_targets,
    teacher_outputs_from_logits,
    xtoken,
    xtoken_teacher_spec,
)


def _both(run, student):
    """(value, grad) with tp_group=None and with the group."""
    out = []
    for tp in (None, "group"):
        student.grad = None
        o = run(tp)
        o.sum.backward()
        out.append((float(o.sum.detach()), student.grad.clone()))
    return out


def _close(a, b):
    assert abs(a[0] - b[0]) <= 1e-5 * max(1.0, abs(a[0]))
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)


@pytest.fixture
def vp_calls(monkeypatch):
    """Counts the calls of each vp_* op, to prove the group path really delegates."""
    import tokenbridge.dist_ops as td

    calls: dict[str, int] = {}
    for name in ("vp_logsumexp", "vp_gather", "vp_topk"):
        orig = getattr(td, name)

        def wrapped(*a, _orig=orig, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _orig(*a, **k)

        monkeypatch.setattr(td, name, wrapped)
    return calls


def test_every_mode_agrees_with_and_without_a_tp_group(group, vp_calls):
    pair = make_pair(11, B=3)
    student, teacher = logits_for(pair, 12)
    idx = index_chunks(pair.batch)
    tgt_t = shift_targets(pair.batch.teacher_ids, pair.batch.teacher_len)
    tgt_s = shift_targets(pair.batch.student_ids, pair.batch.student_len)

    def grp(tp):
        return group if tp else None

    # teacher outputs through the vp ops equal the fused single-device ones
    cfg_g = GoldConfig(divergence="jsd")
    e = torch.full((pair.Vt,), -1)
    e[torch.arange(10)] = torch.arange(10) * 2
    gt = GoldTables.from_exact_map(e, teacher_vocab_size=pair.vt, student_vocab_size=pair.vs)
    spec = gold_teacher_spec(cfg_g, gt, teacher_vocab_size=pair.vt).union(
        xtoken_teacher_spec(XTokenConfig(k=5), teacher_vocab_size=pair.vt)
    )
    kw = {"spec": spec, "target_ids_BT": tgt_t, "columns": gt.t_ids}
    te = teacher_outputs_from_logits(teacher, **kw)
    te_vp = teacher_outputs_from_logits(teacher, tp_group=group, **kw)
    for name, val in te.tensors().items():
        got = getattr(te_vp, name)
        if name.endswith("_ids"):
            assert torch.equal(val, got), name
        else:
            torch.testing.assert_close(got, val, rtol=1e-5, atol=1e-6), name

    ids, w = random_t2s(3, Vt=pair.Vt, vs=pair.vs)
    key = random_key(3, pair.vs, pair.Vs)
    xt = XTokenTables.from_arrays(ids, w, student_vocab_size=pair.vs, s_key=key)
    runs = {
        "ce": lambda tp: ce(student, tgt_s, vocab_size=pair.vs, tp_group=grp(tp)),
        "xtoken": lambda tp: xtoken(
            student, te, idx, tables=xt, vocab_size=pair.vs,
            config=XTokenConfig(k=5, divergence="reverse"), tp_group=grp(tp),
        ),
        "gold_fwd": lambda tp: gold(
            student, te, idx, tables=gt, vocab_size=pair.vs, config=GoldConfig(), tp_group=grp(tp)
        ),
        "gold_jsd": lambda tp: gold(
            student, te, idx, tables=gt, vocab_size=pair.vs, config=cfg_g, tp_group=grp(tp)
        ),
    }  # fmt: skip
    for name, run in runs.items():
        a, b = _both(run, student)
        assert a[0] != 0.0, name
        _close(a, b)

    assert set(vp_calls) == {"vp_logsumexp", "vp_gather", "vp_topk"}
    spec_a = alm_teacher_spec(AlmConfig(), teacher_vocab_size=pair.vt)
    te_a = teacher_outputs_from_logits(teacher, spec=spec_a, target_ids_BT=tgt_t)
    _close(
        *_both(
            lambda tp: alm(
                student, te_a, idx, vocab_size=pair.vs, config=AlmConfig(), tp_group=grp(tp)
            ),
            student,
        )
    )


def test_kd_topk_agrees_with_and_without_a_tp_group(group):
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(2, 5, 30, generator=g) * 2).requires_grad_()
    t = torch.randn(2, 5, 30, generator=g) * 2
    mask = torch.ones(2, 5, dtype=torch.bool)
    for cfg in (KDTopKConfig(k=4, temperature=2.0), KDTopKConfig(k=3, divergence="jsd")):
        te = teacher_outputs_from_logits(t, spec=kd_topk_teacher_spec(cfg, teacher_vocab_size=27))
        _close(
            *_both(
                lambda tp, te=te, cfg=cfg: kd_topk(
                    s, te, mask, vocab_size=27, config=cfg, tp_group=group if tp else None
                ),
                s,
            )
        )
