"""The sampler's lean decode path (`trainer.onpolicy.sampling.decode.LlamaDecoder`) against the HF
forward it replaces: near-equal logits in float32 through prefill, steps, repeats and rows
leaving; the same tokens in float64 (greedy and sampled, stops, n samples, recorded top-k,
biases, another RoPE type, activation-checkpointed blocks); the weight-major products equal
``F.linear`` at every row count; the fallback to the HF forward where the lean path does not
apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.tiny import tiny_llama
from trainer.onpolicy.sampling import orient
from trainer.onpolicy.sampling.decode import HFDecoder, LlamaDecoder, make_decoder
from trainer.onpolicy.sampling.sampler import SamplingConfig, _left_pad, sample

V = 96
PROMPTS = [[1, 5, 9, 11, 40, 41, 2], [1, 7], [1, 30, 31, 32, 33]]  # different lengths


def _decoders(model, prompts, *, new: int):
    ids, mask = _left_pad(prompts, "cpu")
    width = ids.shape[1] + new
    lean = make_decoder(model, vocab_size=V, max_len=width)
    ref = make_decoder(model, vocab_size=V, max_len=width, lean=False)
    assert isinstance(lean, LlamaDecoder) and isinstance(ref, HFDecoder)
    return (ids, mask), lean, ref


@torch.no_grad()
def test_lean_steps_give_the_hf_logits_in_float32():
    """The same tokens fed to both paths: prefill, repeat (n samples), steps, a row leaving and
    more steps give logits equal to float32 rounding."""
    model = tiny_llama(V, seed=3)
    (ids, mask), lean, ref = _decoders(model, PROMPTS, new=8)
    a, b = lean.prefill(ids, mask), ref.prefill(ids, mask)
    assert torch.equal(a, b)  # the prefill is the HF forward itself
    lean.repeat(2)
    ref.repeat(2)
    nxt = a.repeat_interleave(2, 0).argmax(-1)
    for step in range(7):
        if step == 3:  # rows 1 and 4 leave the batch
            keep = torch.tensor([0, 2, 3, 5])
            lean.keep(keep)
            ref.keep(keep)
            nxt = nxt[keep]
        a, b = lean.step(nxt), ref.step(nxt)
        assert a.shape == b.shape == (len(nxt), V) and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        nxt = (nxt * 7 + step) % V  # any tokens: the logits must agree whatever is fed


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "mlp_bias": True},  # biases on every projection
        {  # another RoPE type, through the model's own rotary module
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
        {"num_key_value_heads": 2},  # no GQA
    ],
    ids=["plain", "biases", "llama3-rope", "mha"],
)
def test_lean_sampling_draws_the_hf_paths_tokens_in_float64(overrides):
    """In float64 the two paths' logits agree far below any draw's margin: the same
    completions, stops and recorded top-k, greedy and sampled (top-p, n samples, stop ids)."""
    model = tiny_llama(V, seed=5, **overrides).double()
    for b in model.modules():  # random biases: zeros would hide a missing bias
        if isinstance(b, torch.nn.Linear) and b.bias is not None:
            torch.nn.init.normal_(b.bias, std=0.5)
    greedy = SamplingConfig(temperature=0, max_new_tokens=10, record_topk=4)
    drawn = SamplingConfig(temperature=1.3, top_p=0.9, max_new_tokens=10, n_samples=2,
                           record_topk=4)  # fmt: skip
    for cfg, seeds in ((greedy, None), (drawn, list(range(6)))):
        kw = {"config": cfg, "seeds": seeds, "vocab_size": V}
        free = sample(model, PROMPTS, stop_ids=[], **kw)
        # a stop id the first row meets (its draws up to there are the same): rows leave
        # mid-rollout
        kw["stop_ids"] = [free.completions[0][4]]
        ours, ref = sample(model, PROMPTS, **kw), sample(model, PROMPTS, lean=False, **kw)
        assert ours.completions == ref.completions
        assert ours.stopped == ref.stopped and any(ours.stopped)
        assert all(np.array_equal(x, y) for x, y in zip(ours.topk_ids, ref.topk_ids))


def test_lean_path_reads_through_activation_checkpointing():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain, wrapped = tiny_llama(V, seed=3).double(), tiny_llama(V, seed=3).double()
    layers = wrapped.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8)
    kw = {"config": cfg, "seeds": [4, 5, 6], "stop_ids": [], "vocab_size": V}
    assert isinstance(make_decoder(wrapped, vocab_size=V, max_len=16), LlamaDecoder)
    assert sample(wrapped, PROMPTS, **kw).completions == sample(plain, PROMPTS, **kw).completions


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(48, 16), (16, 48)])  # a tall and a wide weight
def test_projections_equal_f_linear(rows, n, k):
    """Side-by-side weights (q/k/v, gate/up) into one [B, sum N] result, weight-major or not,
    with and without biases: ``F.linear`` of the concatenated weight."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    ws = [torch.randn(n, k, generator=g), torch.randn(n // 2, k, generator=g)]
    b = torch.randn(n + n // 2, generator=g)
    for major in (False, True):
        got = orient.project(x, ws, b, major=major)
        torch.testing.assert_close(got, F.linear(x, torch.cat(ws), b))
        torch.testing.assert_close(
            orient.project(x, ws, None, major=major), F.linear(x, torch.cat(ws))
        )
        strided = x.t().contiguous().t()
        torch.testing.assert_close(orient.project(strided, ws[:1], None, major=major), x @ ws[0].T)


def test_the_hf_forward_where_the_lean_path_does_not_apply():
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = tiny_llama(V)
    assert isinstance(make_decoder(llama, vocab_size=V, max_len=8, tp=True), HFDecoder)
    assert isinstance(make_decoder(llama, vocab_size=V, max_len=8, lean=False), HFDecoder)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2)).eval()
    assert isinstance(make_decoder(gpt2, vocab_size=V, max_len=8), HFDecoder)
    cfg = SamplingConfig(temperature=0, max_new_tokens=5)
    r = sample(gpt2, PROMPTS, config=cfg, seeds=None, stop_ids=[], vocab_size=V)
    assert [len(c) for c in r.completions] == [5, 5, 5]


def test_the_cache_refuses_a_step_past_its_length():
    model = tiny_llama(V)
    ids, mask = _left_pad(PROMPTS, "cpu")
    dec = make_decoder(model, vocab_size=V, max_len=ids.shape[1] + 1)
    with torch.no_grad():
        nxt = dec.prefill(ids, mask).argmax(-1)
        nxt = dec.step(nxt).argmax(-1)
        with pytest.raises(ValueError, match="the cache holds"):
            dec.step(nxt)


def _tiny(model_type: str, **overrides):
    """A tiny random model of another Llama-family type (`LEAN_TYPES`), random biases on."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    shape = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}  # fmt: skip
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape, **overrides))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.normal_(m.bias, std=0.5)
    return model.eval()


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
@torch.no_grad()
def test_mistral_and_qwen2_lean_steps_give_the_hf_logits(model_type):
    """Mistral (a sliding window longer than the rollout) and Qwen2 (q/k/v biases) take the
    lean path, with the HF forward's logits at every step."""
    model = _tiny(model_type, sliding_window=64)
    (ids, mask), lean, ref = _decoders(model, PROMPTS, new=6)
    nxt = lean.prefill(ids, mask).argmax(-1)
    ref.prefill(ids, mask)
    for step in range(6):
        torch.testing.assert_close(lean.step(nxt), ref.step(nxt), rtol=1e-5, atol=1e-5)
        nxt = (nxt * 5 + step) % V


def test_a_sliding_window_shorter_than_the_rollout_takes_the_hf_path():
    """The lean path attends to every position: a window it would overrun is left to HF."""
    short = _tiny("mistral", sliding_window=4)
    assert isinstance(make_decoder(short, vocab_size=V, max_len=16), HFDecoder)
    assert isinstance(make_decoder(short, vocab_size=V, max_len=4), LlamaDecoder)
    qwen = _tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert isinstance(make_decoder(qwen, vocab_size=V, max_len=16), HFDecoder)


@torch.no_grad()
def test_the_products_form_is_measured_once_and_either_gives_the_same_tokens(monkeypatch):
    """The lean step measures both forms of each kind of product (q/k/v, o, gate/up, down,
    lm_head) at its first step with a new row count, keeps the result for the process (a
    planted choice is not measured again), and either form samples the same tokens."""
    model = tiny_llama(V, seed=3).double()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=6)
    kw = {"config": cfg, "seeds": [4, 5, 6], "stop_ids": [], "vocab_size": V}
    monkeypatch.setattr(orient, "_CHOICE", {})
    want = sample(model, PROMPTS, **kw).completions
    threads = torch.get_num_threads()
    at_three = {k[1:3] for k in orient.choices() if k[0] == 3}
    assert at_three == {(64, 32), (32, 32), (128, 32), (32, 64), (V, 32)}  # 5 kinds, 3 rows
    assert all(k[3] == torch.float64 and k[4] == threads for k in orient.choices())
    planted = {k: not v for k, v in orient.choices().items()}
    orient._CHOICE.update(planted)
    assert sample(model, PROMPTS, **kw).completions == want
    assert orient.choices() == planted  # kept, not measured again
    for major in (False, True):
        monkeypatch.setattr(orient, "weight_major", lambda rows, shape, m=major: m)
        assert sample(model, PROMPTS, **kw).completions == want


def test_measured_forms_travel_in_a_checkpoint_and_are_taken_on_resume(monkeypatch):
    """A checkpoint keeps the forms measured (`orient.saved`, JSON through `state_split`); a
    resumed process takes them (`restore`) instead of measuring: the same products, the same
    rounding, the same tokens as the run it resumes."""
    import json

    from trainer.checkpoint.state_split import split

    monkeypatch.setattr(orient, "_CHOICE", {})
    planted = {(2, 192, 64, torch.float32, 1): True, (3, 49_152, 576, torch.float64, 2): False}
    orient._CHOICE.update(planted)
    doc, tensors = split({"product_forms": orient.saved()})
    assert not tensors  # plain JSON values
    monkeypatch.setattr(orient, "_CHOICE", {})  # a fresh process
    orient.restore(json.loads(json.dumps(doc))["product_forms"])
    assert orient.choices() == planted
    # read back at the thread count it was measured with, not at another
    assert orient.weight_major(2, (192, 64, torch.float32)) is (torch.get_num_threads() == 1)
