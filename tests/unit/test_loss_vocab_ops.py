"""vocab_ops and the block driver against plain dense torch, including -inf columns and grads."""

from __future__ import annotations

import pytest
import torch

from tokenbridge.dist_ops import vocab_ops
from tokenbridge.losses.base import divergence, log1mexp
from tokenbridge.losses.ops.rowwise import map_rows, take_rows

NEG = float("-inf")


def _x(seed=0, n=7, v=11):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    x[2, 3] = NEG
    return x


def test_mask_padded_only_masks_columns_beyond_vocab():
    x = _x()
    m = vocab_ops.mask_padded(x, 8)
    assert torch.isinf(m[:, 8:]).all()
    assert torch.equal(m[:, :8][torch.isfinite(x[:, :8])], x[:, :8][torch.isfinite(x[:, :8])])
    assert vocab_ops.mask_padded(x, 11) is x  # nothing to mask: no copy


def test_gather_shared_and_per_row_ids_with_empty_slots():
    x = _x()
    shared = torch.tensor([0, 5, -1, 10])
    got = vocab_ops.gather(x, shared)
    assert torch.equal(got[:, [0, 1, 3]], x[:, [0, 5, 10]])
    assert torch.isinf(got[:, 2]).all()
    per_row = torch.randint(0, 11, (7, 3))
    per_row[0, 1] = -1
    got = vocab_ops.gather(x, per_row)
    assert got[0, 1] == NEG
    assert got[1, 2] == x[1, per_row[1, 2]]


@pytest.mark.parametrize("shared", [True, False])
def test_logsumexp_excluding_matches_dense(shared):
    x = _x(1)
    if shared:
        ids = torch.tensor([1, 4, -1, 9])
        drop = [[1, 4, 9]] * x.shape[0]
    else:
        ids = torch.tensor([[0, 1, -1]] * 7)
        ids[3] = torch.tensor([5, -1, -1])
        drop = [[i for i in row if i >= 0] for row in ids.tolist()]
    ref = torch.stack(
        [torch.logsumexp(x[r, [c for c in range(11) if c not in drop[r]]], 0) for r in range(7)]
    )
    torch.testing.assert_close(vocab_ops.logsumexp_excluding(x, ids), ref)


def test_tail_is_exact_where_one_minus_sum_underflows():
    x = torch.tensor([[40.0, 0.0, 0.0, 0.0]])  # top-1 holds all but ~1e-17 of the mass
    tail = vocab_ops.logsumexp_excluding(x, torch.tensor([[0]])) - vocab_ops.logsumexp(x)
    assert abs(float(tail) - (-40.0 + torch.log(torch.tensor(3.0)))) < 1e-4
    # the naive 1 - p_top rounds to exactly 0 in fp32
    assert float(1 - torch.softmax(x, -1)[0, 0]) == 0.0


def test_topk_entropy_soft_ce_match_dense():
    x = _x(2)
    v, i = vocab_ops.topk(x, 3)
    ref_v, ref_i = torch.sort(x, descending=True)
    assert torch.equal(v, ref_v[:, :3]) and torch.equal(i, ref_i[:, :3])
    p = torch.softmax(x, -1)
    ref_h = -(p * torch.log_softmax(x, -1)).nan_to_num(0.0).sum(-1)
    torch.testing.assert_close(vocab_ops.entropy(x), ref_h)
    t = torch.softmax(torch.randn(7, 11, dtype=torch.float64), -1)
    t[2, 3] = 0.0  # zero target where x is -inf: must stay finite
    ref_ce = -(t * torch.log_softmax(x, -1)).nan_to_num(0.0).sum(-1)
    got = vocab_ops.soft_ce(x, t)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref_ce)


def test_divergences_zero_on_equal_and_finite_grads_with_neg_inf():
    lp = torch.log_softmax(torch.tensor([[1.0, 2.0, NEG, 0.5]], dtype=torch.float64), -1)
    lq = torch.log_softmax(torch.tensor([[0.3, 1.0, NEG, 0.1]], dtype=torch.float64), -1)
    lq.requires_grad_()
    for kind in ("forward", "reverse", "jsd"):
        d = divergence(lp, lq, kind=kind)
        assert float(d.detach()) > 0
        (g,) = torch.autograd.grad(d.sum(), lq)
        assert torch.isfinite(g).all() and g[0, 2] == 0
        assert abs(float(divergence(lp, lp, kind=kind))) < 1e-12


def test_log1mexp_stable_and_zero_grad_at_zero():
    x = torch.tensor([-1e-8, -0.5, -30.0, 0.0], dtype=torch.float64, requires_grad=True)
    y = log1mexp(x)
    ref = torch.log(-torch.expm1(x.detach()[:3]))
    torch.testing.assert_close(y[:3], ref)
    assert y[3] == NEG
    (g,) = torch.autograd.grad(y[:3].sum(), x)
    assert torch.isfinite(g).all() and g[3] == 0


def test_map_rows_matches_direct_and_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 9, generator=g, requires_grad=True)
    rows = torch.tensor([0, 3, 4, 10, 11, 12, 22])
    extra = torch.randn(7, generator=g)

    def fn(block, local, e):
        y = take_rows(block, local)
        return (torch.logsumexp(y, -1) * e,)

    for chunk in (1, 4, 5, 100):
        (out,) = map_rows(fn, x, rows, extra, chunk_size=chunk)
        ref = torch.logsumexp(x[rows], -1) * extra
        torch.testing.assert_close(out, ref)
        (gx,) = torch.autograd.grad(out.sum(), x)
        (gr,) = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(gx, gr)


def test_map_rows_rejects_unsorted_rows():
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match="sorted"):
        map_rows(lambda b, r: (b[r, 0],), x, torch.tensor([3, 1]))
