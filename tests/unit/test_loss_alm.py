"""alm (binarised chain-likelihood matching) against the dense reference."""

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
    ref_alm,
    ref_bin,
    split_invariance,
)
from tokenbridge.losses import (
    AlmConfig,
    alm,
    alm_teacher_spec,
    binary_divergence,
    index_chunks,
    shift_targets,
    teacher_outputs_from_logits,
)


def _teacher(pair, teacher):
    spec = alm_teacher_spec(AlmConfig(), teacher_vocab_size=pair.vt)
    tgt = shift_targets(pair.batch.teacher_ids, pair.batch.teacher_len)
    return teacher_outputs_from_logits(teacher, spec=spec, target_ids_BT=tgt)


def _run(pair, student, teacher, cfg, chunk_size=4):
    return alm(
        student,
        _teacher(pair, teacher),
        index_chunks(pair.batch),
        vocab_size=pair.vs,
        config=cfg,
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize(
    ("kind", "tau"), [("kl", 1.0), ("reverse_kl", 1.0), ("ce", 1.0), ("kl", 4.0)]
)
def test_alm_matches_dense(kind, tau):
    pair = make_pair(0, B=3)
    student, teacher = logits_for(pair, 1, scale=1.0)
    out = _run(pair, student, teacher, AlmConfig(divergence=kind, temperature=tau))
    ref, n = ref_alm(student, teacher, pair, kind=kind, tau=tau)
    assert_matches_ref(out, ref, n, student)


def test_binary_divergence_properties():
    lt = torch.tensor([-0.1, -2.0, -30.0, 0.0], dtype=torch.float64)
    for kind in ("kl", "reverse_kl"):
        assert torch.allclose(
            binary_divergence(lt, lt, kind=kind), torch.zeros(4, dtype=torch.float64), atol=1e-9
        )
    ls = torch.tensor([-0.5, -1.0, -25.0, -1e-3], dtype=torch.float64, requires_grad=True)
    d = binary_divergence(lt, ls, kind="kl")
    torch.testing.assert_close(d, ref_bin(lt, ls, "kl"))
    assert (d > 0).all()
    (g,) = torch.autograd.grad(d.sum(), ls)
    assert torch.isfinite(g).all()
    # ce = kl + the teacher's binary entropy (constant for the student)
    a = torch.exp(lt - 1e-6)
    h = -(a * torch.log(a) + (1 - a) * torch.log1p(-a))
    torch.testing.assert_close(binary_divergence(lt, ls, kind="ce"), d + h)


def test_alm_gradcheck_float64():
    pair = make_pair(2, B=2, vs=8, vt=10, max_chunks=3)
    student, teacher = logits_for(pair, 3, dtype=torch.float64, scale=1.0)
    te = _teacher(pair, teacher)
    idx = index_chunks(pair.batch)
    for kind in ("kl", "reverse_kl"):
        cfg = AlmConfig(divergence=kind, temperature=2.0)
        assert torch.autograd.gradcheck(
            lambda x, c=cfg: alm(x, te, idx, vocab_size=pair.vs, config=c, chunk_size=3).sum,
            (student,),
            fast_mode=True,
        )


def test_alm_edge_cases_and_bf16():
    pair = make_pair(4, B=4, empty_side_prob=0.3, bos=False)
    student, teacher = logits_for(pair, 5, scale=1.0)
    out = _run(pair, student, teacher, AlmConfig())
    ref, n = ref_alm(student, teacher, pair)
    assert int(out.count) == n
    assert int(out.metrics["chunks_empty_side"]) > 0 and int(out.metrics["chunks_unpredicted"]) > 0
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    assert_bf16_close(lambda s, t: _run(pair, s, t, AlmConfig()), student, teacher, ref)
    empty = alm(
        student,
        _teacher(pair, teacher),
        index_chunks(chunkless_batch(pair)),
        vocab_size=pair.vs,
        config=AlmConfig(),
    )
    assert_empty_loss(empty, student)


def test_alm_neg_inf_logit_on_a_target_is_inf_not_nan():
    """A student that rules out a token the text contains has chain likelihood 0: the loss is
    +inf (a real divergence), never NaN."""
    pair = make_pair(6, B=2)
    student, teacher = logits_for(pair, 7, scale=1.0)
    with torch.no_grad():
        tok = pair.rows[0]["student_ids"][1]
        student[0, 0, tok] = float("-inf")
    out = _run(pair, student, teacher, AlmConfig())
    assert float(out.sum.detach()) == float("inf")


def test_alm_microbatch_split_invariance():
    pair = make_pair(8, B=4)
    student, teacher = logits_for(pair, 9, scale=1.0)
    split_invariance(
        pair,
        student,
        teacher,
        lambda sp, s, t: _run(sp, s, t, AlmConfig(temperature=2.0), chunk_size=3),
    )
