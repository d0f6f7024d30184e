"""Sampling from an int8 copy of the student (``onpolicy.sampler_weights: int8``) and the
likelihood-ratio weights that make the step's loss the on-policy one (`trainer.onpolicy.sampling.int8`,
`trainer.onpolicy.importance`): the int8 products and decode steps close to fp32's; the sampler
records the log-probability of each drawn token under the distribution it drew from (replayed
token by token, top-p included, against a sorting reference); the prefix weights turn an
expectation over q's completions into the one over p's exactly (every completion enumerated);
the gradient hook weights each position's gradient as a dense weighted loss would; the clear
refusals."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.tiny import tiny_llama
from tokenbridge.losses.ops.head_logits import HeadLogits, project
from trainer.config.checks import ConfigError
from trainer.config.loss_sections import OnPolicyConfig
from trainer.onpolicy.importance import policy_logprobs, prefix_weights, scale_grad
from trainer.onpolicy.sampling.decode import LlamaDecoder, make_decoder
from trainer.onpolicy.sampling.draw import drawn_logprobs
from trainer.onpolicy.sampling.int8 import Int8Linear, int8_available
from trainer.onpolicy.sampling.sampler import SamplingConfig, _left_pad, sample

pytestmark = pytest.mark.skipif(not int8_available(), reason="no fbgemm in this torch build")
V = 96
PROMPTS = [[1, 5, 9, 11, 40, 41, 2], [1, 7], [1, 30, 31, 32, 33]]


def test_int8_products_are_close_to_fp32():
    torch.manual_seed(0)
    w1, w2, b = torch.randn(48, 32) * 0.1, torch.randn(16, 32) * 0.1, torch.randn(64)
    x = torch.randn(3, 32)
    want = x @ torch.cat([w1, w2]).T + b
    got = Int8Linear([w1, w2], b)(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


@torch.no_grad()
def test_int8_decode_steps_are_close_to_the_models():
    model = tiny_llama(V, seed=3)
    ids, mask = _left_pad(PROMPTS, "cpu")
    exact = make_decoder(model, vocab_size=V, max_len=ids.shape[1] + 6)
    quant = make_decoder(model, vocab_size=V, max_len=ids.shape[1] + 6, weights="int8")
    assert isinstance(quant, LlamaDecoder)
    a, b = exact.prefill(ids, mask), quant.prefill(ids, mask)
    assert torch.equal(a, b)  # the prefill is the model's own forward
    nxt = a.argmax(-1)
    for _ in range(5):
        a, b = exact.step(nxt), quant.step(nxt)
        pa, pb = a.softmax(-1), b.softmax(-1)
        assert 0 < (pa - pb).abs().sum(-1).max() < 0.1  # differs, by a few percent of mass
        nxt = a.argmax(-1)


def _sorting_reference(logits_V: torch.Tensor, token: int, *, temperature: float, top_p: float):
    """log p(token) under top-p sampling, by sorting: the smallest most-likely prefix whose mass
    reaches top_p, renormalised."""
    p = torch.softmax(logits_V.double() / temperature, -1)
    order = p.argsort(descending=True)
    cum = p[order].cumsum(0)
    keep = order[: int((cum < top_p).sum()) + 1]
    if token not in keep.tolist():
        return -math.inf
    return float(p[token].log() - p[keep].sum().log())


def test_drawn_logprobs_match_a_sorting_reference():
    torch.manual_seed(1)
    logits = torch.randn(4, V) * 3
    ids = torch.tensor([0, 5, 17, 90])
    for t, top_p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.5)):
        cfg = SamplingConfig(temperature=t, top_p=top_p)
        got = drawn_logprobs(logits, ids, config=cfg)
        for b in range(4):
            want = _sorting_reference(logits[b], int(ids[b]), temperature=t, top_p=top_p)
            if math.isfinite(want):  # a drawn token is always in the nucleus
                assert float(got[b]) == pytest.approx(want, abs=1e-4)


def test_the_nucleus_mass_beyond_the_top_k_falls_back_to_a_sort():
    from trainer.onpolicy.sampling.draw import _nucleus_mass

    torch.manual_seed(4)
    peaked = torch.softmax(torch.randn(3, 500) * 4, -1)  # the top 8 hold 0.5
    flat = torch.softmax(torch.randn(2, 500) * 0.1, -1)  # they do not: sorted
    for p in (peaked, flat):
        for top_p in (0.5, 0.95):
            got = _nucleus_mass(p, top_p, k=8)
            srt = p.sort(-1, descending=True).values
            want = torch.where(srt.cumsum(-1) - srt < top_p, srt, 0.0).sum(-1)
            torch.testing.assert_close(got, want)


@torch.no_grad()
def test_a_copy_made_once_serves_later_rollouts_alike():
    from trainer.onpolicy.sampling.decode import int8_weights

    model = tiny_llama(V, seed=6)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=5, weights="int8")
    kw = {"config": cfg, "seeds": [1, 2, 3], "stop_ids": [], "vocab_size": V}
    copy = int8_weights(model, vocab_size=V, threads=2)
    a, b = sample(model, PROMPTS, **kw, int8=copy), sample(model, PROMPTS, **kw)
    assert a.completions == b.completions
    assert all((x == y).all() for x, y in zip(a.logprobs, b.logprobs))


@torch.no_grad()
def test_the_sampler_records_the_distribution_it_drew_from():
    """Replay the rollouts' tokens through a fresh int8 decoder, the same batch with the same
    rows leaving (its activations are quantized per call, over the live rows): the recorded
    log-probs are those of the int8 logits, top-p applied, at every drawn token."""
    model = tiny_llama(V, seed=5)
    cfg = SamplingConfig(temperature=0.9, top_p=0.8, max_new_tokens=6, weights="int8")
    r = sample(model, PROMPTS, config=cfg, seeds=[11, 12, 13], stop_ids=[3], vocab_size=V)
    assert r.logprobs is not None and [len(x) for x in r.logprobs] == list(map(len, r.completions))
    ids, mask = _left_pad(PROMPTS, "cpu")
    dec = make_decoder(model, vocab_size=V, max_len=ids.shape[1] + 6, weights="int8")
    logits, live = dec.prefill(ids, mask), list(range(len(PROMPTS)))
    for j in range(6):
        toks = torch.tensor([r.completions[b][j] for b in live])
        want = drawn_logprobs(logits, toks, config=cfg)
        for i, b in enumerate(live):
            assert float(r.logprobs[b][j]) == pytest.approx(float(want[i]), abs=1e-6)
        keep = [i for i, b in enumerate(live) if len(r.completions[b]) > j + 1]
        if not keep or j == 5:
            break
        if len(keep) < len(live):
            dec.keep(torch.tensor(keep))
            live, toks = [live[i] for i in keep], toks[keep]
        logits = dec.step(toks)
    exact = SamplingConfig(temperature=0.9, top_p=0.8, max_new_tokens=6)
    plain = sample(model, PROMPTS, config=exact, seeds=[11, 12, 13], stop_ids=[3], vocab_size=V)
    assert plain.logprobs is None  # the model's own weights: nothing to correct


def test_prefix_weights_turn_q_expectations_into_p_expectations_exactly():
    """Every completion of 3 tokens over 4 ids, drawn from q; sum_t w_t f_t(y_<t) weighted by
    q(y) equals the same sum unweighted under p(y), with no cap."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 4, 3

    def table():  # a conditional distribution per prefix
        return {pre: torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0).double()
                for k in range(n) for pre in itertools.product(range(vocab), repeat=k)}  # fmt: skip

    p, q, f = table(), table(), {pre: float(torch.randn(1, generator=g)) for pre in table()}
    want = got = 0.0
    for y in itertools.product(range(vocab), repeat=n):
        lp = torch.tensor([[float(p[y[:t]][y[t]].log()) for t in range(n)]])
        lq = torch.tensor([[float(q[y[:t]][y[t]].log()) for t in range(n)]])
        terms = [f[y[:t]] for t in range(n)]
        w, _ = prefix_weights(lp, lq, torch.tensor([list(y)]), clip=math.inf)
        got += float(lq.sum().exp()) * sum(float(w[0, t]) * terms[t] for t in range(n))
        want += float(lp.sum().exp()) * sum(terms)
    assert got == pytest.approx(want, rel=1e-5)


def test_prefix_weights_cap_skip_untargeted_positions_and_zero_after_an_impossible_token():
    targets = torch.tensor([[-1, 4, 5, 6, 7, -1]])
    lq = torch.zeros(1, 6)
    lp = torch.tensor([[0.0, 1.0, 1.0, -math.inf, 0.0, 0.0]])
    w, stats = prefix_weights(lp, lq, targets, clip=2.0)
    # the first target's state has no completion token: 1; then e^1 capped at 2; e^2 capped;
    # after the token p cannot draw, 0; untargeted positions: 1
    assert w.tolist() == [[1.0, 1.0, 2.0, 2.0, 0.0, 1.0]]
    assert not torch.isnan(w).any()
    assert stats["ratio/clipped_frac"] == pytest.approx(2 / 4)
    assert stats["ratio/weight_mean"] == pytest.approx(5 / 4)


def test_policy_logprobs_read_the_targets_and_the_sampled_columns():
    torch.manual_seed(2)
    logits = torch.randn(2, 5, V + 4)  # a padded lm_head: the sampler draws from V columns
    targets = torch.tensor([[-1, 3, 8, -1, -1], [-1, -1, 2, 9, 1]])
    cfg = SamplingConfig(temperature=1.0, top_p=1.0)
    got = policy_logprobs(logits, targets, config=cfg, vocab=V)
    want = torch.log_softmax(logits[..., :V], -1).gather(-1, targets.clamp(min=0)[..., None])[
        ..., 0
    ]
    assert torch.allclose(got, torch.where(targets >= 0, want, 0.0), atol=1e-6)
    # logits never whole: the same from the head's input and weight, in blocks of 2 rows
    hidden, weight = torch.randn(2, 5, 8), torch.randn(V + 4, 8)
    head = HeadLogits(hidden, weight, None, 2)
    cfg = SamplingConfig(temperature=0.8, top_p=0.7)
    whole = policy_logprobs(project(hidden, weight, softcap=None), targets, config=cfg, vocab=V)
    torch.testing.assert_close(policy_logprobs(head, targets, config=cfg, vocab=V), whole)
    assert torch.equal(scale_grad(head, torch.ones(2, 5)).row_scale, torch.ones(2, 5))


def test_scale_grad_weights_each_positions_gradient_as_a_weighted_loss_would():
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 7, requires_grad=True)
    ref = logits.detach().clone().requires_grad_(True)
    w = torch.rand(2, 4) * 2
    target = torch.randn(2, 4, 7).softmax(-1)

    def per_position(x):  # a KD-like term per position: cross-entropy to a target
        return -(target * x.log_softmax(-1)).sum(-1)

    assert scale_grad(logits, w) is logits
    per_position(logits).sum().backward()
    (w * per_position(ref)).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad)


def test_int8_is_refused_where_it_cannot_run():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2)).eval()
    with pytest.raises(ValueError, match="sampler_weights=int8: it needs the lean decode path"):
        make_decoder(gpt2, vocab_size=V, max_len=8, weights="int8")
    with pytest.raises(ValueError, match="lean decode path"):
        make_decoder(tiny_llama(V), vocab_size=V, max_len=8, weights="int8", tp=True)
    with pytest.raises(ValueError, match="not greedy"):
        SamplingConfig(temperature=0, weights="int8")
    with pytest.raises(ConfigError, match="onpolicy.sampler_weights"):
        OnPolicyConfig(sampler_weights="fp16")
    with pytest.raises(ConfigError, match="onpolicy.ratio_clip"):
        OnPolicyConfig(ratio_clip=0.5)
    with pytest.raises(ConfigError, match="onpolicy.sampler_refresh"):
        OnPolicyConfig(sampler_refresh=0)


def test_the_config_refuses_int8_sampling_on_a_gpu_or_under_tp():
    from trainer.config.compose import compose_config

    base = ["experiment=onpolicy_debug", "onpolicy.sampler_weights=int8"]
    for extra in ("device=cuda", "parallel.tp=2"):
        with pytest.raises(ConfigError, match="int8 sampling runs on CPU at tp=1"):
            compose_config([*base, extra])
    assert compose_config([*base, "device=cpu"]).onpolicy.sampler_weights == "int8"
