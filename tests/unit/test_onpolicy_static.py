"""The sampler's fixed-shape loop (`trainer.onpolicy.sampling.static`, a CUDA graph on a GPU,
eager here): the static decode step gives the dynamic step's logits; the loop samples exactly
the dynamic loop's tokens, stops and recorded top-k with the same seeds (float64: draws far
from rounding), across stop checks and blocks of uniforms; it stops at the first check after
every row has; what the GPU captures reads nothing back to the host; what it refuses; on
CUDA, the captured graph samples the CPU's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.tiny import tiny_llama
from trainer.onpolicy.sampling.decode import LlamaDecoder, StaticLlamaDecoder, make_decoder
from trainer.onpolicy.sampling.sampler import SamplingConfig, _left_pad, sample
from trainer.onpolicy.sampling.static import STOP_EVERY

V = 96
PROMPTS = [[1, 5, 9, 11, 40, 41, 2], [1, 7], [1, 30, 31, 32, 33]]  # different lengths


@pytest.fixture(scope="module")
def model64():
    return tiny_llama(V, seed=5).double()


@torch.no_grad()
def test_the_static_step_gives_the_dynamic_steps_logits():
    """Whole-cache attention under the bias, positions on the device, the cache written at a
    tensor index: the dynamic step's logits to float32 rounding, through n samples."""
    model = tiny_llama(V, seed=3)
    ids, mask = _left_pad(PROMPTS, "cpu")
    width = ids.shape[1] + 8
    static = make_decoder(model, vocab_size=V, max_len=width, static=True)
    plain = make_decoder(model, vocab_size=V, max_len=width)
    assert isinstance(static, StaticLlamaDecoder) and type(plain) is LlamaDecoder
    a, b = static.prefill(ids, mask), plain.prefill(ids, mask)
    assert torch.equal(a, b)
    static.repeat(2)
    plain.repeat(2)
    nxt = a.repeat_interleave(2, 0).argmax(-1)
    for step in range(8):
        a, b = static.step(nxt), plain.step(nxt)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        nxt = (nxt * 7 + step) % V
    assert int(static.t_1) == plain.t == width
    with pytest.raises(ValueError, match="keeps every row"):
        static.keep(torch.tensor([0]))


def test_the_static_loop_samples_the_dynamic_loops_tokens(model64):
    """Greedy and sampled (top-p, n samples, recorded top-k), with stop ids some rows meet:
    the same completions, stops and top-k; past 64 steps too (a second block of uniforms,
    several stop checks)."""
    greedy = SamplingConfig(temperature=0, max_new_tokens=12, record_topk=3)
    drawn = SamplingConfig(temperature=1.2, top_p=0.8, max_new_tokens=12, n_samples=2,
                           record_topk=3)  # fmt: skip
    long = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=70)
    for cfg, seeds in ((greedy, None), (drawn, list(range(6))), (long, [3, 4, 5])):
        kw = {"config": cfg, "seeds": seeds, "vocab_size": V}
        free = sample(model64, PROMPTS, stop_ids=[], **kw)
        kw["stop_ids"] = [free.completions[0][5]]  # the first row stops at step 5 or before
        dynamic = sample(model64, PROMPTS, **kw)
        static = sample(model64, PROMPTS, static=True, **kw)
        assert static.completions == dynamic.completions
        assert static.stopped == dynamic.stopped and static.stopped[0]
        if cfg.record_topk:
            assert all(np.array_equal(x, y) for x, y in zip(static.topk_ids, dynamic.topk_ids))
        assert static.prompt_index == dynamic.prompt_index


def test_the_static_loop_stops_at_the_first_check_after_every_row_has(model64):
    """Every row stops at its first token: the loop runs the steps up to the next stop check
    (finished rows masked, nothing written for them), then ends; on_step before each step."""
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=40)
    calls = []
    r = sample(model64, PROMPTS, config=cfg, seeds=[1, 2, 3], stop_ids=range(V), vocab_size=V,
               static=True, on_step=lambda: calls.append(1))  # fmt: skip
    assert all(len(c) == 1 for c in r.completions) and all(r.stopped)
    assert len(calls) == STOP_EVERY - 1
    kw = {"config": SamplingConfig(temperature=1.0, max_new_tokens=6), "seeds": [4, 5, 6],
          "stop_ids": [], "vocab_size": V}  # fmt: skip
    calls.clear()
    got = sample(model64, PROMPTS, static=True, on_step=lambda: calls.append(torch.rand(1)), **kw)
    assert got.completions == sample(model64, PROMPTS, **kw).completions
    assert len(calls) == 5  # 6 tokens: the prefill's logits, then 5 decode steps


class _NoHostReads(TorchDispatchMode):
    """Fails on any op that reads a device value back to the host (what a CUDA graph cannot
    capture): ``.item()``/``bool()``, ``nonzero``, boolean-mask indexing, ``masked_select``."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        assert name not in self.SYNCING, f"{func} reads the device from the host"
        if name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else []
            assert not any(getattr(i, "dtype", None) == torch.bool for i in indices or []), func
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_the_captured_step_reads_nothing_back_to_the_host(model64):
    """What the GPU captures (decode step, top-p draw, recording) runs here under a dispatch
    mode that fails on every op that would sync: top-p with its fallback, stop ids, top-k."""
    from trainer.onpolicy.sampling.draw import Uniforms
    from trainer.onpolicy.sampling.static import StaticLoop

    cfg = SamplingConfig(temperature=1.0, top_p=0.3, max_new_tokens=6, record_topk=2)
    ids, mask = _left_pad(PROMPTS, "cpu")
    dec = make_decoder(model64, vocab_size=V, max_len=ids.shape[1] + 6, static=True)
    logits = dec.prefill(ids, mask)
    loop = StaticLoop(dec, config=cfg, uniforms=Uniforms([1, 2, 3], device="cpu"),
                      stop_S=torch.tensor([3, 4]), graph=False)  # fmt: skip
    loop.uniforms.fill(0)
    loop._draw(logits)
    loop._step()  # the products' forms measured (orient.tune) outside the mode
    with _NoHostReads():
        for _ in range(3):
            loop._step()
    assert int(loop.step_1) == 5 and (loop.tokens_RN[:, :5] >= -1).all()


def test_what_the_static_loop_refuses():
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = tiny_llama(V)
    int8 = SamplingConfig(temperature=1.0, max_new_tokens=4, weights="int8")
    with pytest.raises(ValueError, match="model's own weights"):
        sample(llama, PROMPTS, config=int8, seeds=[1, 2, 3], stop_ids=[], vocab_size=V,
               static=True)  # fmt: skip
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2)).eval()
    greedy = SamplingConfig(temperature=0, max_new_tokens=4)
    for model, lean in ((gpt2, True), (llama, False)):
        with pytest.raises(ValueError, match="static=True needs the lean decode path"):
            sample(model, PROMPTS, config=greedy, seeds=None, stop_ids=[], vocab_size=V,
                   lean=lean, static=True)  # fmt: skip


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_captured_graph_samples_the_cpus_tokens(model64):
    """On a GPU the default loop is the static one, its step a CUDA graph replayed: in float64
    it samples the CPU's tokens (dynamic and static alike), stops and top-k included."""
    cfg = SamplingConfig(temperature=1.1, top_p=0.9, max_new_tokens=40, n_samples=2,
                         record_topk=3)  # fmt: skip
    kw = {"config": cfg, "seeds": list(range(6)), "vocab_size": V}
    free = sample(model64, PROMPTS, stop_ids=[], **kw)
    kw["stop_ids"] = [free.completions[0][9]]
    want = sample(model64, PROMPTS, **kw)
    got = sample(model64.cuda(), PROMPTS, **kw)
    model64.cpu()
    assert got.completions == want.completions and got.stopped == want.stopped
    assert all(np.array_equal(x, y) for x, y in zip(got.topk_ids, want.topk_ids))
