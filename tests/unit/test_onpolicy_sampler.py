"""The on-policy sampler: greedy equals HF `generate`, the KV cache and left padding give the
logits of a plain forward, stops and max_new_tokens, seeds, exact top-p, n samples; the
rollout phase's `gathered` block changes no output, with FSDP2 or without."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.tiny import tiny_llama
from trainer.onpolicy.sampling.draw import Uniforms, choose
from trainer.onpolicy.sampling.sampler import SamplingConfig, _left_pad, gathered, sample

V = 96
PROMPTS = [[1, 5, 9, 11, 40, 41, 2], [1, 7], [1, 30, 31, 32, 33]]  # different lengths


@pytest.fixture(scope="module")
def model():
    return tiny_llama(V, seed=3)


def test_greedy_equals_hf_generate(model):
    cfg = SamplingConfig(temperature=0, max_new_tokens=12)
    ours = sample(model, PROMPTS, config=cfg, seeds=None, stop_ids=[], vocab_size=V)
    ids, mask = _left_pad(PROMPTS, "cpu")
    with torch.no_grad():
        ref = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0
        )
    assert ours.completions == ref[:, ids.shape[1] :].tolist()
    assert ours.stopped == [False] * 3 and ours.new_tokens == 36


def test_cached_steps_see_the_logits_of_a_plain_forward(model):
    """The recorded top-k at every sampled position equals the top-k of one forward over the
    unpadded prompt + completion: positions, masks and the cache are right for every row."""
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10, record_topk=5)
    r = sample(model, PROMPTS, config=cfg, seeds=[1, 2, 3], stop_ids=[], vocab_size=V)
    for p, c, top in zip(r.prompts, r.completions, r.topk_ids):
        seq = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(p) - 1 : len(p) + len(c) - 1]
        assert np.array_equal(logits.topk(5).indices.numpy(), top)


def test_stops_at_a_stop_id_and_respects_max_new_tokens(model):
    free = sample(
        model, PROMPTS, config=SamplingConfig(temperature=0, max_new_tokens=9), seeds=None,
        stop_ids=[], vocab_size=V,
    )  # fmt: skip
    stop = free.completions[0][3]
    r = sample(
        model, PROMPTS, config=SamplingConfig(temperature=0, max_new_tokens=9), seeds=None,
        stop_ids=[stop], vocab_size=V,
    )  # fmt: skip
    for full, got, stopped in zip(free.completions, r.completions, r.stopped):
        if stop in full:
            cut = full.index(stop) + 1
            assert got == full[:cut] and stopped  # the stop id is kept as the last token
        else:
            assert got == full and len(got) == 9 and not stopped
    assert r.stopped[0]


def test_seeds_make_sampling_reproducible_and_layout_free(model):
    cfg = SamplingConfig(temperature=1.3, max_new_tokens=8)
    a = sample(model, PROMPTS, config=cfg, seeds=[7, 8, 9], stop_ids=[], vocab_size=V)
    b = sample(model, PROMPTS, config=cfg, seeds=[7, 8, 9], stop_ids=[], vocab_size=V)
    assert a.completions == b.completions
    # a rollout's completion depends on its prompt and seed, not on its batch
    alone = sample(model, PROMPTS[1:2], config=cfg, seeds=[8], stop_ids=[], vocab_size=V)
    assert alone.completions[0] == a.completions[1]
    other = sample(model, PROMPTS, config=cfg, seeds=[1, 8, 9], stop_ids=[], vocab_size=V)
    assert other.completions[0] != a.completions[0]


def test_n_samples_share_one_prefill(model):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=6, n_samples=3)
    r = sample(model, PROMPTS, config=cfg, seeds=list(range(9)), stop_ids=[], vocab_size=V)
    assert r.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert r.prompts[4] == PROMPTS[1]
    assert len({tuple(c) for c in r.completions[:3]}) > 1
    greedy = SamplingConfig(temperature=0, max_new_tokens=6, n_samples=2)
    g = sample(model, PROMPTS, config=greedy, seeds=None, stop_ids=[], vocab_size=V)
    assert g.completions[0] == g.completions[1]


def test_never_samples_past_the_tokenizer_vocabulary(model):
    cfg = SamplingConfig(temperature=5.0, max_new_tokens=20)
    r = sample(model, PROMPTS, config=cfg, seeds=[1, 2, 3], stop_ids=[], vocab_size=10)
    assert max(max(c) for c in r.completions) < 10


def test_top_p_is_exact():
    """Frequencies of many draws match p restricted to the nucleus, renormalised; nothing
    outside the nucleus is ever drawn; the eager and the static chooser draw the same tokens."""
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    logits = probs.log()[None].repeat(4000, 1)
    u = Uniforms(range(4000), device="cpu").at(0)
    cfg = SamplingConfig(temperature=1.0, top_p=0.75)
    got = choose(logits, config=cfg, u_BW=u)
    counts = torch.bincount(got, minlength=6).double() / 4000
    # nucleus: 0.40 + 0.25 < 0.75, then 0.15 reaches it: tokens 0, 1, 2
    want = torch.tensor([0.40, 0.25, 0.15, 0, 0, 0]) / 0.80
    assert counts[3:].sum() == 0
    assert torch.allclose(counts, want.double(), atol=0.03)
    assert torch.equal(got, choose(logits, config=cfg, u_BW=u, static=True))


def test_gathered_is_a_no_op_without_fsdp(model):
    """On a plain model the block changes nothing: the logits inside and after it, and a greedy
    sample's completions and recorded top-k, are bit-identical to those without it (the same
    forward on the same weights: nothing to tolerate), and the parameters are the same tensors
    holding the same values."""
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cfg = SamplingConfig(temperature=0, max_new_tokens=6, record_topk=4)
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with torch.no_grad():
        want = model(input_ids=ids).logits
    ref = sample(model, PROMPTS, config=cfg, seeds=None, stop_ids=[], vocab_size=V)
    with gathered(model, reshard_after_forward=True):
        with torch.no_grad():
            out = model(input_ids=ids).logits
        got = sample(model, PROMPTS, config=cfg, seeds=None, stop_ids=[], vocab_size=V)
    assert out.shape == (2, 3, V)
    assert torch.equal(out, want)
    assert got.completions == ref.completions
    assert all(np.array_equal(a, b) for a, b in zip(got.topk_ids, ref.topk_ids))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    now = dict(model.named_parameters())
    assert now.keys() == params.keys() and all(now[n] is p for n, (p, _) in params.items())
    assert all(torch.equal(p, kept) for p, kept in params.values())


@pytest.fixture
def one_rank(tmp_path):
    if dist.is_initialized():  # another test left a one-process group: use it as it is
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_gathered_keeps_fsdp_parameters_whole_and_the_outputs_bit_identical(one_rank):
    """Under FSDP2 (one rank, gloo) the block keeps every parameter unsharded across forwards
    and reshards after it, restoring ``reshard_after_forward``; the logits inside and after it
    are bit-identical to an unwrapped copy's (one rank's shard is the whole tensor, so the
    gathered weights are the same values and the forward the same kernels)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    plain, wrapped = tiny_llama(V, seed=3), tiny_llama(V, seed=3)
    for layer in wrapped.model.layers:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(wrapped, reshard_after_forward=True)

    def weight():  # looked up each time: FSDP2 registers the sharded or the whole parameter
        return wrapped.model.layers[0].mlp.up_proj.weight

    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        assert torch.equal(wrapped(input_ids=ids).logits, want)
        assert isinstance(weight(), DTensor)  # resharded after each forward
        with gathered(wrapped, reshard_after_forward=True):
            for _ in range(2):
                assert torch.equal(wrapped(input_ids=ids).logits, want)
                assert not isinstance(weight(), DTensor)  # still whole after a forward
        assert isinstance(weight(), DTensor)
        assert torch.equal(wrapped(input_ids=ids).logits, want)
        assert isinstance(weight(), DTensor)  # reshard_after_forward is back


def test_fsdp_samples_on_the_lean_path_inside_gathered_and_on_hf_outside(one_rank):
    """Inside `gathered` the parameters are whole, so an FSDP2 Llama decodes on the lean path
    (`decode.LlamaDecoder`); outside they are DTensors and it falls back to the HF forward.
    Both sample what the unwrapped model samples (float64: draws far from float rounding)."""
    from torch.distributed.fsdp import fully_shard

    from trainer.onpolicy.sampling.decode import HFDecoder, LlamaDecoder, make_decoder

    plain, wrapped = tiny_llama(V, seed=3).double(), tiny_llama(V, seed=3).double()
    for layer in wrapped.model.layers:
        fully_shard(layer)
    fully_shard(wrapped)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8, record_topk=3)
    kw = {"config": cfg, "seeds": [1, 2, 3], "stop_ids": [], "vocab_size": V}
    want = sample(plain, PROMPTS, **kw)
    assert isinstance(make_decoder(wrapped, vocab_size=V, max_len=8), HFDecoder)
    outside = sample(wrapped, PROMPTS, **kw)
    with gathered(wrapped, reshard_after_forward=True):
        assert isinstance(make_decoder(wrapped, vocab_size=V, max_len=8), LlamaDecoder)
        inside = sample(wrapped, PROMPTS, **kw)
    for got in (outside, inside):
        assert got.completions == want.completions
        assert all(np.array_equal(a, b) for a, b in zip(got.topk_ids, want.topk_ids))


def test_on_step_is_polled_before_every_decode_step_and_changes_no_draw(model):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=6)
    kw = {"config": cfg, "seeds": [4, 5, 6], "stop_ids": [], "vocab_size": V}
    want = sample(model, PROMPTS, **kw).completions
    calls = []
    got = sample(model, PROMPTS, on_step=lambda: calls.append(torch.rand(1)), **kw)
    assert got.completions == want  # the global RNG drawn from in between: no effect
    assert len(calls) == 5  # 6 tokens: the prefill's logits, then 5 decode steps


def test_release_gives_torch_its_threads_back_once_the_work_beside_is_over():
    """Lag 1's sampler (`sampler.ThreadRelease`): lowered threads while the teachers score,
    every thread again from the first poll that finds them done, and never lowered again."""
    from trainer.onpolicy.sampling.sampler import ThreadRelease
    from trainer.parallel.cpus import torch_threads

    before, state = torch.get_num_threads(), {"done": False}
    release = ThreadRelease(lambda: state["done"], threads=before + 1)
    with torch_threads(1):
        release()
        assert torch.get_num_threads() == 1 and release.held_s is None
        state["done"] = True
        release()
        assert torch.get_num_threads() == before + 1 and release.held() == release.held_s >= 0
        state["done"] = False
        release()
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
