"""ce against the dense reference: values, grads, gradcheck, bf16, masking, microbatch splits."""

from __future__ import annotations

import torch

from tests.unit.test_loss_refs import logits_for, make_pair, ref_ce, split_invariance
from tokenbridge.losses import ce, shift_targets


def _targets(pair):
    return shift_targets(pair.batch.student_ids, pair.batch.student_len)


def test_ce_matches_dense_values_and_grads():
    pair = make_pair(0, B=3)
    student, _ = logits_for(pair, 1)
    out = ce(student, _targets(pair), vocab_size=pair.vs, chunk_size=5)
    ref, n = ref_ce(student, pair)
    assert int(out.count) == n
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    (g,) = torch.autograd.grad(out.sum, student)
    (gr,) = torch.autograd.grad(ref, student)
    torch.testing.assert_close(g, gr.float(), rtol=1e-5, atol=1e-5)
    assert (g[..., pair.vs :] == 0).all()  # padded lm_head columns get no gradient
    masked = student.detach().clone()
    masked[..., pair.vs :] = float("-inf")
    tg = _targets(pair)
    hits = ((masked.argmax(-1) == tg) & (tg >= 0)).sum()
    assert int(out.metrics["ce_correct"]) == int(hits)


def test_ce_gradcheck_float64():
    pair = make_pair(1, B=2, vs=7, vt=9, max_chunks=2)
    student, _ = logits_for(pair, 2, dtype=torch.float64)
    tg = _targets(pair)
    assert torch.autograd.gradcheck(
        lambda x: ce(x, tg, vocab_size=pair.vs, chunk_size=3).sum, (student,), fast_mode=True
    )


def test_ce_bf16_close_to_fp32():
    pair = make_pair(2)
    student, _ = logits_for(pair, 3)
    tg = _targets(pair)
    full = ce(student, tg, vocab_size=pair.vs).sum.detach()
    half_in = student.detach().bfloat16().requires_grad_()
    half = ce(half_in, tg, vocab_size=pair.vs).sum
    half.backward()
    assert half.dtype == torch.float32 and half_in.grad.dtype == torch.bfloat16
    assert abs(float(half.detach()) - float(full)) < 0.02 * abs(float(full))


def test_ce_everything_masked_and_neg_inf_logits():
    pair = make_pair(3)
    student, _ = logits_for(pair, 4)
    with torch.no_grad():
        student[0, 0, 3] = float("-inf")
    none = torch.full_like(_targets(pair), -1)
    out = ce(student, none, vocab_size=pair.vs)
    assert float(out.sum.detach()) == 0.0 and int(out.count) == 0
    out.sum.backward()
    assert torch.isfinite(student.grad).all() and (student.grad == 0).all()
    out = ce(student, _targets(pair), vocab_size=pair.vs)
    assert torch.isfinite(out.sum)


def test_ce_microbatch_split_invariance():
    pair = make_pair(4, B=4)
    student, teacher = logits_for(pair, 5)
    split_invariance(
        pair,
        student,
        teacher,
        lambda sp, s, t: ce(s, _targets(sp), vocab_size=pair.vs, chunk_size=4),
    )
