"""How the sampler draws (`trainer.onpolicy.sampling.draw`): the counter-based uniforms equal a
plain-integer reference of the same hash (so no int64 product wraps, and CUDA's integer ops
give the same numbers), are reproducible per seed whatever the batch, differ per step, round
and seed, and look uniform and independent; the chooser draws exact top-p through its
fallback too, the same tokens eagerly and statically; identical on CPU and CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.onpolicy.sampling import draw
from trainer.onpolicy.sampling.draw import ROUNDS, WIDTH, Uniforms, choose, uniforms
from trainer.onpolicy.sampling.sampler import SamplingConfig


def _mix_ref(x: int) -> int:
    """`draw.mix32` in Python integers mod 2^32."""
    for shift, mult in draw._ROUNDS32:
        x = ((x ^ (x >> shift)) * mult) & draw._M32
    return x ^ (x >> 14)


def _uniform_ref(seed: int, step: int, j: int) -> float:
    """The ``j``-th uniform of ``seed`` at ``step``, as `draw.uniforms` defines it."""
    s = seed % 2**64
    key = _mix_ref(_mix_ref((s & draw._M32) ^ draw._SEED) ^ (s >> 32))
    h = _mix_ref(key ^ ((step * draw._GOLDEN) & draw._M32))
    hi = _mix_ref(h ^ (((2 * j + 1) * draw._WORD) & draw._M32))
    lo = _mix_ref(h ^ (((2 * j + 2) * draw._WORD) & draw._M32))
    return ((hi << 21) | (lo >> 11)) / 2**53


def test_uniforms_equal_a_plain_integer_reference():
    seeds = [0, 1, 7, 2**32 - 1, 2**32 + 5, 2**64 - 1, -3, 123_456_789_012_345]
    got = uniforms(draw.row_keys(seeds, "cpu"), first=62, steps=3)
    assert got.dtype == torch.float64 and got.shape == (len(seeds), 3, WIDTH)
    for b, seed in enumerate(seeds):
        for s in range(3):
            for j in range(WIDTH):
                assert got[b, s, j].item() == _uniform_ref(seed, 62 + s, j)
    x = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    assert draw.mix32(x).tolist() == [_mix_ref(v) for v in x.tolist()]
    assert len(set(draw.mix32(torch.arange(1 << 16)).tolist())) == 1 << 16  # a bijection


def test_uniforms_are_per_rollout_whatever_the_batch_and_block():
    """A row's uniforms depend on its seed and step only: not on the rows beside it, their
    order, or which block of steps they were computed in."""
    a = Uniforms([5, 9, 11], device="cpu")
    b = Uniforms([11, 5], device="cpu")
    for step in (0, 3, 63, 64, 200):
        ua, ub = a.at(step), b.at(step)
        assert torch.equal(ua[0], ub[1]) and torch.equal(ua[2], ub[0])
    whole = uniforms(draw.row_keys([9], "cpu"), first=0, steps=130)[0]
    assert torch.equal(whole[64], a.at(64)[1]) and torch.equal(whole[129], a.at(129)[1])
    u = whole.flatten().tolist()
    assert len(set(u)) == len(u)  # every step and round its own number
    assert not torch.equal(a.at(7)[0], a.at(7)[1])  # and every seed


def test_uniforms_look_uniform_and_independent():
    """At 512 seeds x 64 steps x 5 rounds: the empirical CDF within a KS bound of the uniform
    one; neighbouring seeds, steps and rounds uncorrelated; pairs of neighbouring seeds fill a
    16 x 16 grid evenly (chi-square). Bounds are ~4 standard deviations: never flaky."""
    u_BSW = uniforms(draw.row_keys(range(512), "cpu"), first=0, steps=64)
    flat = u_BSW.flatten().sort().values
    n = len(flat)
    ks = (flat - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max()
    assert ks < 2.0 / math.sqrt(n)
    assert float(flat[0]) >= 0 and float(flat[-1]) < 1
    for x, y in ((u_BSW[1:], u_BSW[:-1]), (u_BSW[:, 1:], u_BSW[:, :-1]),
                 (u_BSW[..., 1:], u_BSW[..., :-1])):  # fmt: skip
        corr = torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1]
        assert abs(float(corr)) < 4 / math.sqrt(x.numel())
    cell = (u_BSW[0::2] * 16).long() * 16 + (u_BSW[1::2] * 16).long()
    counts = torch.bincount(cell.flatten(), minlength=256).double()
    expect = cell.numel() / 256
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 255 + 4 * math.sqrt(2 * 255)


def _logits(rows: int, vocab: int, *, seed: int, scale: float) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_eager_and_static_choosers_draw_the_same_tokens(top_p):
    """Round by round for the rejected rows (eager) or all rounds and the fallback for every
    row at once (static): the same token for every row, at top-p where the fallback is rare
    (0.9), common (0.5) or the rule (0.05: the nucleus is often one token)."""
    logits = _logits(300, 500, seed=1, scale=2.0)
    cfg = SamplingConfig(temperature=0.8, top_p=top_p)
    u = Uniforms(range(300), device="cpu").at(3)
    eager = choose(logits, config=cfg, u_BW=u)
    assert torch.equal(eager, choose(logits, config=cfg, u_BW=u, static=True))
    greedy = SamplingConfig(temperature=0)
    assert torch.equal(choose(logits, config=greedy, u_BW=None), logits.argmax(-1))
    assert torch.equal(choose(logits, config=greedy, u_BW=None, static=True), logits.argmax(-1))


def test_the_nucleus_fallback_alone_draws_exact_top_p():
    """Rows where no round lands in the nucleus draw over the sorted nucleus: with every round
    forced out of it (uniforms of 1 pick the least likely token), the frequencies are those of
    p restricted to the nucleus and renormalised, in vocabulary order or not."""
    probs = torch.tensor([0.06, 0.40, 0.10, 0.25, 0.15, 0.04])
    logits = probs.log()[None].repeat(6000, 1)
    u = Uniforms(range(6000), device="cpu").at(0).clone()
    u[:, :ROUNDS] = 1 - 2**-53
    cfg = SamplingConfig(temperature=1.0, top_p=0.75)
    for static in (False, True):
        got = choose(logits, config=cfg, u_BW=u, static=static)
        counts = torch.bincount(got, minlength=6).double() / len(got)
        want = torch.tensor([0, 0.40, 0, 0.25, 0.15, 0]) / 0.80
        assert counts[[0, 2, 5]].sum() == 0
        assert torch.allclose(counts, want.double(), atol=0.03)


def test_a_token_of_probability_zero_is_never_drawn():
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]]).repeat(2000, 1)
    u = Uniforms(range(2000), device="cpu").at(0)
    for cfg in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_p=0.6)):
        got = choose(logits, config=cfg, u_BW=u)
        assert set(got.tolist()) == {0, 2}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_uniforms_and_draws_are_the_same_on_cuda():
    """The same integers on either device, so the same uniforms; on the same logits the
    static chooser on the GPU draws the CPU's tokens (float64 logits: far from rounding)."""
    seeds = list(range(0, 2**40, 2**33 + 17))
    cpu = uniforms(draw.row_keys(seeds, "cpu"), first=0, steps=70)
    gpu = uniforms(draw.row_keys(seeds, "cuda"), first=0, steps=70)
    assert torch.equal(cpu, gpu.cpu())
    logits = _logits(len(seeds), 300, seed=2, scale=2.0).double()
    cfg = SamplingConfig(temperature=1.0, top_p=0.7)
    want = choose(logits, config=cfg, u_BW=cpu[:, 5])
    got = choose(logits.cuda(), config=cfg, u_BW=gpu[:, 5], static=True)
    assert torch.equal(got.cpu(), want)
