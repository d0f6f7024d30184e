"""Single-process (world size 1) checks of the vocab-parallel ops against dense references.

The same Functions run with `group=None`; the multi-process cases in tests/dist check the
sharded path. Values and gradients within 1e-5 in fp32; chunking must not change results.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.references import (
    ref_entropy,
    ref_soft_ce,
    ref_target_logprobs,
    ref_topk,
    value_and_grad,
)
from tokenbridge.dist_ops import (
    vp_entropy,
    vp_gather,
    vp_log_softmax,
    vp_logsumexp,
    vp_soft_ce,
    vp_softmax,
    vp_target_logprobs,
    vp_topk,
)
from tokenbridge.dist_ops.sampling import float_key, key_float

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _logits(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def _close(actual, expected, **tol):
    torch.testing.assert_close(actual, expected.to(actual.dtype), **(tol or TOL))


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logsumexp_log_softmax_softmax(chunk_size, temperature):
    x = _logits(3, 5, 37)
    cases = [
        (vp_logsumexp, lambda z: torch.logsumexp(z.double() / temperature, -1)),
        (vp_log_softmax, lambda z: torch.log_softmax(z.double() / temperature, -1)),
        (vp_softmax, lambda z: torch.softmax(z.double() / temperature, -1)),
    ]
    for op, ref in cases:
        out, grad = value_and_grad(
            lambda z, op=op: op(z, None, temperature=temperature, chunk_size=chunk_size), x
        )
        ref_out, ref_grad = value_and_grad(ref, x)
        _close(out, ref_out)
        _close(grad, ref_grad)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("k_dim", [False, True])
def test_target_logprobs_plain(chunk_size, k_dim):
    x = _logits(4, 6, 41, seed=1)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 41, (4, 6, 5) if k_dim else (4, 6), generator=gen)
    for temperature in (1.0, 1.7):
        out, grad = value_and_grad(
            lambda z, t=temperature: vp_target_logprobs(
                z, ids, None, temperature=t, chunk_size=chunk_size
            ),
            x,
        )
        ref_out, ref_grad = value_and_grad(
            lambda z, t=temperature: ref_target_logprobs(z, ids, temperature=t), x
        )
        assert out.shape == ids.shape
        _close(out, ref_out)
        _close(grad, ref_grad)


def test_gather_logprob_gradient_rule():
    """dz = -softmax * sum_k g_k + scatter_add(g), written out by hand (repeated ids too)."""
    x = _logits(3, 11, seed=3)
    ids = torch.tensor([[0, 0, 5], [10, 2, 3], [4, 4, 4]])
    g = torch.tensor([[1.0, 2.0, -1.0], [0.5, 0.0, 3.0], [1.0, 1.0, 1.0]])
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((vp_target_logprobs(leaf, ids, None) * g).sum(), leaf)
    expected = -torch.softmax(x, -1) * g.sum(-1, keepdim=True)
    expected = expected.scatter_add(1, ids, g)
    _close(grad, expected)


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(5, None), (None, 0.7), (7, 0.8), (1, None), (None, 0.05), (50, 1.0)]
)
def test_target_logprobs_truncated(top_k, top_p):
    x = _logits(6, 40, seed=4, scale=2.0)
    gen = torch.Generator().manual_seed(5)
    ids = torch.cat([x.topk(3, -1).indices, torch.randint(0, 40, (6, 4), generator=gen)], -1)
    kw = {"temperature": 0.9, "top_k": top_k, "top_p": top_p}
    out, grad = value_and_grad(lambda z: vp_target_logprobs(z, ids, None, chunk_size=4, **kw), x)
    ref_out, ref_grad = value_and_grad(lambda z: ref_target_logprobs(z, ids, **kw), x)
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref_out))
    assert torch.isfinite(out[:, 0]).all()  # the most likely token always survives
    _close(out, ref_out)
    _close(grad, ref_grad)
    if top_k == 1:
        assert (out[:, 0] == 0).all() and torch.isinf(out[:, 1:3]).all()


def test_topp_keeps_ties_together():
    """Tied logits are kept or dropped together (independent of any shard order)."""
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, -5.0]])
    ids = torch.arange(5).unsqueeze(0)
    p_top = torch.softmax(x, -1)[0, 0].item()
    out = vp_target_logprobs(x, ids, None, top_p=p_top + 0.01)
    assert torch.isfinite(out[0, :4]).all() and torch.isinf(out[0, 4])


def test_gather_any_tensor_and_unowned_ids():
    x = _logits(2, 3, 9, seed=6)
    ids = torch.tensor([[[0, 8], [-1, 4], [3, 100]], [[1, 1], [-100, 2], [7, 0]]])
    out, grad = value_and_grad(lambda z: vp_gather(z, ids, None), x)
    owned = (ids >= 0) & (ids < 9)
    expected = torch.where(owned, x.gather(-1, ids.clamp(0, 8)), 0.0)
    _close(out, expected)
    assert grad.abs().sum() > 0 and grad[1, 1, :].abs().sum() == grad[1, 1, 2].abs()


@pytest.mark.parametrize("chunk_size", [None, 1, 5])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("padded", [False, True])
def test_entropy_and_soft_ce(chunk_size, temperature, padded):
    logits = _logits(3, 4, 29, seed=7)
    target = torch.softmax(_logits(3, 4, 29, seed=8), -1)
    target[0, 0, :10] = 0.0  # a sub-distribution, with zeros
    if padded:  # padded lm_head columns: -inf logits, zero target mass
        logits[..., -3:] = float("-inf")
        target[..., -3:] = 0.0
    kw = {"temperature": temperature, "chunk_size": chunk_size}
    out, grad = value_and_grad(lambda z: vp_entropy(z, None, **kw), logits)
    ref_out, ref_grad = value_and_grad(lambda z: ref_entropy(z, temperature), logits)
    _close(out, ref_out)
    _close(grad, ref_grad)
    out, grad = value_and_grad(lambda z: vp_soft_ce(z, target, None, **kw), logits)
    ref_out, ref_grad = value_and_grad(lambda z: ref_soft_ce(z, target, temperature), logits)
    _close(out, ref_out)
    _close(grad, ref_grad)


def test_soft_ce_gives_target_no_gradient():
    x = _logits(2, 10, seed=9).requires_grad_(True)
    t = torch.softmax(_logits(2, 10, seed=10), -1).requires_grad_(True)
    vp_soft_ce(x, t, None).sum().backward()
    assert x.grad is not None and t.grad is None


def test_topk_values_ids_and_grad():
    x = _logits(3, 4, 50, seed=11)
    leaf = x.clone().requires_grad_(True)
    vals, ids = vp_topk(leaf, 6, None)
    (grad,) = torch.autograd.grad(vals.sum(), leaf)
    ref_vals, ref_ids = ref_topk(x, 6)
    assert torch.equal(ids, ref_ids)
    _close(vals, ref_vals)
    assert torch.equal(grad, torch.zeros_like(x).scatter(-1, ref_ids, 1.0))


def test_bf16_logits_upcast_inside():
    """bf16 logits: results equal the fp32 op on the same (bf16-rounded) values."""
    x = _logits(4, 64, seed=12, scale=8.0).to(torch.bfloat16)
    ids = torch.arange(4) * 7
    out, grad = value_and_grad(lambda z: vp_target_logprobs(z, ids, None, chunk_size=1), x)
    ref_out, ref_grad = value_and_grad(lambda z: ref_target_logprobs(z.float(), ids), x)
    assert out.dtype == torch.float32 and grad.dtype == torch.bfloat16
    _close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad.to(torch.bfloat16), rtol=1e-2, atol=1e-2)


def test_float_key_is_order_preserving_and_invertible():
    vals = torch.tensor(
        [float("-inf"), -3e38, -2.5, -1e-30, -0.0, 0.0, 1e-40, 1e-30, 1.0, 3e38, float("inf")]
    )
    keys = float_key(vals)
    assert (keys[1:] >= keys[:-1]).all()
    assert keys[4] == keys[5]  # -0.0 folded into +0.0
    assert torch.equal(key_float(keys), vals + 0.0)


def test_bad_arguments_are_named():
    x = _logits(2, 8)
    with pytest.raises(ValueError, match="temperature"):
        vp_logsumexp(x, None, temperature=0.0)
    with pytest.raises(ValueError, match="ids must have shape"):
        vp_target_logprobs(x, torch.zeros(3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="top_p"):
        vp_target_logprobs(x, torch.zeros(2, dtype=torch.long), None, top_p=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        vp_entropy(x, None, chunk_size=0)
    with pytest.raises(ValueError, match="k must be"):
        vp_topk(x, 9, None)
    with pytest.raises(ValueError, match="target_probs"):
        vp_soft_ce(x, x[:, :4], None)
