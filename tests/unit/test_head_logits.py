"""Logits never whole (`HeadLogits`): every loss mode gives the values and gradients of the
whole-logits path when handed the lm_head's input and weight instead of the [B, S, V] logits.

The reference is the same loss on ``hidden @ weight.T`` made whole (float64, so equality is
tight); the gradients compared are those of the hidden states and of the weight, the two leaves
a training step has. Blocks of 3 rows (smaller than a row) make every block boundary matter.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_loss_modes import _same_tokenizer, mode_inputs
from tests.unit.test_loss_refs import logits_for, make_pair
from tokenbridge.losses.base import zero_sum_like
from tokenbridge.losses.ce import ce
from tokenbridge.losses.modes import KD_MODES, MODES
from tokenbridge.losses.ops.head_logits import HeadLogits, project
from tokenbridge.losses.ops.rowwise import map_rows
from tokenbridge.losses.ops.segments import shift_targets

H = 6


def _leaves(shape_BS, V: int, seed: int, *, padded_from: int):
    """(hidden [B, S, H], weight [V, H]) float64 leaves; padded columns' weights are large so
    that a missed vocabulary mask changes every result."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape_BS, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    weight[padded_from:] *= 20
    return hidden.requires_grad_(), weight.requires_grad_()


def _both(loss_fn, hidden, weight, *, softcap=None, chunk=3, scale=None):
    """(value, d hidden, d weight) of ``loss_fn(logits)`` for whole logits, then for a head;
    ``scale`` (the rows' shape): each row's logits gradient scaled, by a hook on the whole
    logits (the dense reference) and by the head's ``row_scale``."""
    results = []
    for whole in (True, False):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        if whole:
            logits = project(h, w, softcap=softcap)
            if scale is not None:
                logits.register_hook(lambda g: g * scale[..., None])
        else:
            logits = HeadLogits(h, w, softcap, chunk, scale)
        out = loss_fn(logits)
        out.backward()
        results.append((out.detach(), h.grad, w.grad))
    return results


def _assert_same(results):
    (v0, h0, w0), (v1, h1, w1) = results
    torch.testing.assert_close(v1, v0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h1, h0, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(w1, w0, rtol=1e-9, atol=1e-11)
    assert h0.abs().sum() > 0 and w0.abs().sum() > 0


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_ce_equals_the_whole_logits(softcap):
    pair = make_pair(3, B=3)
    targets = shift_targets(pair.batch.student_ids, pair.batch.student_len)
    hidden, weight = _leaves(tuple(targets.shape), pair.Vs, 4, padded_from=pair.vs)

    def loss(logits):
        return ce(logits, targets, vocab_size=pair.vs).sum

    _assert_same(_both(loss, hidden, weight, softcap=softcap))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row_scale"])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("name", KD_MODES)
def test_every_mode_equals_the_whole_logits(name, softcap, scaled):
    r = MODES[name]
    pair = make_pair(11, B=3)
    if r.same_tokenizer:
        pair = _same_tokenizer(pair)
    student, teacher = logits_for(pair, 12, dtype=torch.float64)
    hidden, weight = _leaves(tuple(student.shape[:2]), pair.Vs, 14, padded_from=pair.vs)
    whole = project(hidden.detach(), weight.detach(), softcap=softcap)
    options, tables, outs, prep = mode_inputs(name, pair, teacher, whole, temperature=1.5)

    def loss(logits):
        out = r.loss(logits, outs, prep, tables=tables, vocab_size=pair.vs, config=options)
        assert int(out.count) == r.count(prep) > 0
        return out.sum

    g = torch.Generator().manual_seed(15)
    scale = torch.rand(hidden.shape[:-1], generator=g, dtype=torch.float64) * 2 if scaled else None
    _assert_same(_both(loss, hidden, weight, softcap=softcap, scale=scale))


def test_a_head_projects_only_the_rows_a_loss_selects():
    """map_rows over a head: fn sees exactly the selected rows, in order, block by block."""
    hidden, weight = _leaves((10,), 7, 5, padded_from=7)
    rows = torch.tensor([0, 4, 5, 9])
    seen = []

    def fn(block, local):
        seen.append(block.shape[0])
        assert torch.equal(local, torch.arange(block.shape[0]))
        return (block.sum(-1),)

    (got,) = map_rows(fn, HeadLogits(hidden, weight, chunk=4), rows)
    torch.testing.assert_close(got, (hidden @ weight.t())[rows].sum(-1))
    assert seen == [1, 1, 1, 1] or seen == [1, 2, 1]  # blocks [0, 4), [4, 8), [8, 10)


def test_a_head_refuses_what_it_cannot_be():
    hidden, weight = _leaves((2, 3), 7, 6, padded_from=7)
    with pytest.raises(ValueError, match="hidden size"):
        HeadLogits(hidden, weight[:, :4])
    with pytest.raises(ValueError, match="chunk"):
        HeadLogits(hidden, weight, chunk=0)
    head = HeadLogits(hidden, weight)
    assert head.shape == (2, 3, 7) and head.reshape(6, 7).shape == (6, 7)
    with pytest.raises(ValueError, match="vocabulary last"):
        head.reshape(42)
    z = zero_sum_like(head)
    z.backward()
    assert float(z.detach()) == 0.0 and hidden.grad is not None
