"""kd_topk (teacher top-k + tail, and the on-policy core) against the dense reference."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_loss_refs import logits_for, make_pair, ref_kd_topk, split_invariance
from tokenbridge.losses import (
    KDTopKConfig,
    kd_topk,
    kd_topk_teacher_spec,
    student_topk_ids,
    teacher_outputs_from_logits,
)

V = 40


def _same_tokenizer(seed, B=3, T=6, dtype=torch.float32, vocab=V - 4):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    t = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    s[..., vocab:] = 40.0  # padded columns, must be masked
    t[..., vocab:] = 40.0
    mask = torch.rand(B, T, generator=g) < 0.8
    return s.requires_grad_(), t, mask


def _teacher(t, config, vocab=V - 4, columns=None):
    spec = kd_topk_teacher_spec(config, teacher_vocab_size=vocab)
    return teacher_outputs_from_logits(t, spec=spec, columns=columns)


@pytest.mark.parametrize(
    ("kind", "tau"),
    [("forward", 1.0), ("reverse", 1.0), ("jsd", 1.0), ("forward", 2.0), ("jsd", 0.7)],
)
def test_kd_topk_matches_dense(kind, tau):
    s, t, mask = _same_tokenizer(0)
    cfg = KDTopKConfig(k=5, divergence=kind, beta=0.3, temperature=tau)
    out = kd_topk(s, _teacher(t, cfg), mask, vocab_size=V - 4, config=cfg, chunk_size=4)
    ref = ref_kd_topk(s, t, mask, vs=V - 4, k=5, kind=kind, beta=0.3, tau=tau)
    assert int(out.count) == int(mask.sum())
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    (g,) = torch.autograd.grad(out.sum, s)
    (gr,) = torch.autograd.grad(ref, s)
    torch.testing.assert_close(g, gr.float(), rtol=1e-5, atol=1e-5)
    assert float(out.sum.detach()) > 0


def test_on_policy_core_scores_the_students_own_topk():
    s, t, mask = _same_tokenizer(1)
    cfg = KDTopKConfig(k=4, support="columns")
    ids = student_topk_ids(s, 4, vocab_size=V - 4)
    masked = s.detach().clone()
    masked[..., V - 4 :] = float("-inf")
    assert torch.equal(ids.long(), masked.topk(4, -1).indices)
    out = kd_topk(s, _teacher(t, cfg, columns=ids), mask, vocab_size=V - 4, config=cfg)
    ref = ref_kd_topk(s, t, mask, vs=V - 4, k=4, support=ids.long())
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    (g,) = torch.autograd.grad(out.sum, s)
    (gr,) = torch.autograd.grad(ref, s)
    torch.testing.assert_close(g, gr.float(), rtol=1e-5, atol=1e-5)


def test_kd_topk_gradcheck_float64():
    s, t, mask = _same_tokenizer(2, B=2, T=3, dtype=torch.float64)
    for kind in ("forward", "reverse", "jsd"):
        cfg = KDTopKConfig(k=3, divergence=kind, temperature=1.5)
        teacher = _teacher(t, cfg)
        assert torch.autograd.gradcheck(
            lambda x, te=teacher, c=cfg: (
                kd_topk(x, te, mask, vocab_size=V - 4, config=c, chunk_size=2).sum
            ),
            (s,),
            fast_mode=True,
        )


def test_kd_topk_bf16_and_neg_inf_logits():
    s, t, mask = _same_tokenizer(3)
    with torch.no_grad():  # a column both models rule out: p = q = 0 there
        s[..., 7] = float("-inf")
        t[..., 7] = float("-inf")
    cfg = KDTopKConfig(k=6, divergence="jsd")
    teacher = _teacher(t, cfg)
    out = kd_topk(s, teacher, mask, vocab_size=V - 4, config=cfg)
    ref = ref_kd_topk(s, t, mask, vs=V - 4, k=6, kind="jsd")
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    out.sum.backward()
    assert torch.isfinite(s.grad).all()
    half = s.detach().bfloat16().requires_grad_()
    out16 = kd_topk(half, _teacher(t.bfloat16(), cfg), mask, vocab_size=V - 4, config=cfg)
    out16.sum.backward()
    assert torch.isfinite(half.grad.float()).all()
    r = float(ref.detach())
    assert abs(float(out16.sum.detach()) - r) < 0.05 * r


def test_kd_topk_everything_masked_and_more_k_than_finite_logits():
    s, t, mask = _same_tokenizer(4)
    cfg = KDTopKConfig(k=3)
    out = kd_topk(s, _teacher(t, cfg), torch.zeros_like(mask), vocab_size=V - 4, config=cfg)
    assert float(out.sum.detach()) == 0.0 and int(out.count) == 0
    out.sum.backward()
    assert (s.grad == 0).all()
    with torch.no_grad():
        t[0, 0, 2:] = float("-inf")  # only 2 finite teacher logits, k = 3: an empty slot
    teacher = _teacher(t, cfg)
    assert int(teacher.topk_ids[0, 0, 2]) == -1
    out = kd_topk(s, teacher, mask, vocab_size=V - 4, config=cfg)
    ref = ref_kd_topk(s, t, mask, vs=V - 4, k=3)
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)


def test_kd_topk_microbatch_split_invariance():
    pair = make_pair(5, B=4)
    student, teacher_logits = logits_for(pair, 6)
    cfg = KDTopKConfig(k=4, divergence="reverse")
    vocab = pair.vs

    def run(sp, s, t):
        # same tokenizer: the student's own logits play the teacher (different seed-derived values)
        te = teacher_outputs_from_logits(
            s.detach() * 0.5 + 1.0, spec=kd_topk_teacher_spec(cfg, teacher_vocab_size=vocab)
        )
        mask = torch.arange(s.shape[1])[None, :] < sp.batch.student_len[:, None] - 1
        return kd_topk(s, te, mask, vocab_size=vocab, config=cfg, chunk_size=3)

    split_invariance(pair, student, teacher_logits, run)


def test_kd_topk_rejects_mismatched_teacher():
    s, t, mask = _same_tokenizer(6)
    cfg = KDTopKConfig(k=3, support="columns")
    with pytest.raises(ValueError, match="col_ids"):
        kd_topk(s, _teacher(t, KDTopKConfig(k=3)), mask, vocab_size=V - 4, config=cfg)
    with pytest.raises(ValueError, match="student vocab_size"):
        kd_topk(s, _teacher(t, KDTopKConfig(k=3)), mask, vocab_size=10, config=KDTopKConfig(k=3))
