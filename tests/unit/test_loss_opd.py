"""On-policy losses against dense references computed by hand on a tiny vocabulary: top-k OPD
(direct, every divergence), the policy-gradient estimator (value, gradient, and its expectation
= grad KL(q || p) by enumerating every token), the probability-space mixture."""

from __future__ import annotations

import math

import pytest
import torch

from tokenbridge.losses.base import divergence
from tokenbridge.losses.kd_topk import student_topk_ids
from tokenbridge.losses.modes import MODES
from tokenbridge.losses.opd import OPDPGConfig, OPDTopKConfig, mix_teacher_outputs
from tokenbridge.losses.ops.segments import AlignedBatch, index_chunks
from tokenbridge.teacher.outputs import teacher_outputs_from_logits

V, B, T, K = 11, 2, 6, 4
PROMPT = 2  # the first PROMPT tokens of every row are the prompt


def _rollout_batch(ids_BT: torch.Tensor) -> tuple[AlignedBatch, torch.Tensor]:
    """A same-tokenizer rollout batch: one chunk per completion token, targets on completions."""
    b, t = ids_BT.shape
    chunk = torch.full_like(ids_BT, -1)
    chunk[:, PROMPT:] = torch.arange(t - PROMPT)
    lens = torch.full((b,), t)
    aligned = AlignedBatch(ids_BT, lens, chunk, ids_BT, lens, chunk, torch.full((b,), t - PROMPT))
    targets = torch.full_like(ids_BT, -1)
    targets[:, PROMPT - 1 : -1] = ids_BT[:, PROMPT:]
    return aligned, targets


def _spec(mode: str, options):
    return MODES[mode].teacher_spec(options, None, teacher_vocab_size=V)


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    zs = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    zt = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    ids = torch.randint(0, V, (B, T), generator=g)
    return zs, zt, ids


@pytest.mark.parametrize("kind", ["reverse", "forward", "jsd"])
@pytest.mark.parametrize("k", [K, V])
def test_opd_topk_equals_dense_buckets(tensors, kind, k):
    zs, zt, ids = tensors
    opts = OPDTopKConfig(k=k, divergence=kind, beta=0.3)
    aligned, targets = _rollout_batch(ids)
    cols = student_topk_ids(zs, k, vocab_size=V)  # the sampling policy's support
    outs = teacher_outputs_from_logits(zt, spec=_spec("opd_topk", opts), columns=cols)
    mask = MODES["opd_topk"].prepare(aligned, targets)
    x = zs.clone().requires_grad_(True)
    out = MODES["opd_topk"].loss(x, outs, mask, tables=None, vocab_size=V, config=opts)
    out.sum.backward()

    y = zs.clone().requires_grad_(True)
    logq, logp = torch.log_softmax(y, -1), torch.log_softmax(zt, -1)
    ref = torch.zeros((), dtype=torch.float64)
    for b, t in mask.nonzero().tolist():
        s = cols[b, t].long()
        q, p = logq[b, t, s].exp(), logp[b, t, s].exp()
        if k == V:  # the support is the whole vocabulary: no tail, the full divergence
            Q, P = q, p
        else:  # the k ids + the tail bucket
            Q = torch.cat([q, (1 - q.sum())[None]])
            P = torch.cat([p, (1 - p.sum())[None]])
        ref = ref + divergence(P.log()[None], Q.log()[None], kind=kind, beta=0.3)[0]
    ref.backward()
    assert int(out.count) == int(mask.sum()) == B * (T - PROMPT)
    # the teacher ships fp32 log-probs: agreement to fp32 precision
    assert torch.allclose(out.sum, ref, rtol=1e-6)
    assert torch.allclose(x.grad, y.grad, rtol=1e-5, atol=1e-7)


def test_opd_pg_value_and_gradient(tensors):
    zs, zt, ids = tensors
    aligned, _ = _rollout_batch(ids)
    index = index_chunks(aligned)
    outs = teacher_outputs_from_logits(
        zt, spec=_spec("opd_pg", OPDPGConfig()), target_ids_BT=_shift(ids)
    )
    x = zs.clone().requires_grad_(True)
    out = MODES["opd_pg"].loss(x, outs, index, tables=None, vocab_size=V, config=OPDPGConfig())
    out.sum.backward()

    y = zs.clone().requires_grad_(True)
    lq = torch.log_softmax(y, -1)[:, PROMPT - 1 : -1].gather(-1, ids[:, PROMPT:, None])[..., 0]
    lp = torch.log_softmax(zt, -1)[:, PROMPT - 1 : -1].gather(-1, ids[:, PROMPT:, None])[..., 0]
    value = (lq - lp).sum()
    surrogate = -((lp - lq).detach() * lq).sum()
    surrogate.backward()
    assert int(out.count) == B * (T - PROMPT)
    assert torch.allclose(out.sum, value.detach(), rtol=1e-6)
    assert torch.allclose(x.grad, y.grad, rtol=1e-5, atol=1e-7)


def _shift(ids_BT: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(ids_BT, -1)
    out[:, :-1] = ids_BT[:, 1:]
    return out


def test_opd_pg_expectation_is_the_reverse_kl_gradient():
    """sum_x q(x) grad[opd_pg on the one-token completion x] = grad KL(q || p), exactly."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(V, generator=g, dtype=torch.float64)
    zt = torch.randn(V, generator=g, dtype=torch.float64)
    q = torch.softmax(z, -1)
    expected = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        ids = torch.tensor([[3, x]])
        aligned, _ = _rollout_batch_len(ids, prompt=1)
        logits = torch.stack([z, torch.zeros(V, dtype=torch.float64)])[None].requires_grad_(True)
        t_logits = torch.stack([zt, torch.zeros(V, dtype=torch.float64)])[None]
        outs = teacher_outputs_from_logits(
            t_logits, spec=_spec("opd_pg", OPDPGConfig()), target_ids_BT=_shift(ids)
        )
        out = MODES["opd_pg"].loss(
            logits, outs, index_chunks(aligned), tables=None, vocab_size=V, config=OPDPGConfig()
        )
        out.sum.backward()
        expected += q[x] * logits.grad[0, 0]
    y = z.clone().requires_grad_(True)
    # the teacher's log-probs as it ships them (fp32), so the identity is exact to fp64
    lp = torch.log_softmax(zt.float(), -1).double()
    lq = torch.log_softmax(y, -1)
    (lq.exp() * (lq - lp)).sum().backward()
    assert torch.allclose(expected, y.grad, rtol=1e-6, atol=1e-7)


def _rollout_batch_len(ids_BT, *, prompt):
    b, t = ids_BT.shape
    chunk = torch.full_like(ids_BT, -1)
    chunk[:, prompt:] = torch.arange(t - prompt)
    lens = torch.full((b,), t)
    n = torch.full((b,), t - prompt)
    return AlignedBatch(ids_BT, lens, chunk, ids_BT, lens, chunk, n), None


def test_mixture_is_the_mixed_distribution(tensors):
    """Mixing two teachers' shipped log-probs = the outputs of the mixed distribution."""
    zs, zt, ids = tensors
    zt2 = zt.flip(-1) * 0.7
    opts = OPDTopKConfig(k=K)
    spec = _spec("opd_topk", opts).union(_spec("opd_pg", OPDPGConfig()))
    cols = student_topk_ids(zs, K, vocab_size=V)
    tgt = _shift(ids)
    o1 = teacher_outputs_from_logits(zt, spec=spec, columns=cols, target_ids_BT=tgt)
    o2 = teacher_outputs_from_logits(zt2, spec=spec, columns=cols, target_ids_BT=tgt)
    mixed = mix_teacher_outputs([o1, o2], [3.0, 1.0])
    logmix = torch.logsumexp(
        torch.stack([torch.log_softmax(zt, -1) + math.log(0.75),
                     torch.log_softmax(zt2, -1) + math.log(0.25)]), 0)  # fmt: skip
    ref = teacher_outputs_from_logits(logmix, spec=spec, columns=cols, target_ids_BT=tgt)
    for name in ("col_logprobs", "col_rest_logprob"):
        assert torch.allclose(getattr(mixed, name).double(), getattr(ref, name).double(), atol=1e-5)
    has = tgt >= 0
    assert torch.allclose(mixed.target_logprob[has].double(), ref.target_logprob[has].double(),
                          atol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="different column ids"):
        mix_teacher_outputs([o1, teacher_outputs_from_logits(zt, spec=spec, columns=cols.flip(-1),
                                                             target_ids_BT=tgt)], [1, 1])  # fmt: skip
