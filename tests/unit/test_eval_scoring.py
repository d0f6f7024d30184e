"""Eval scoring against hand references: tiny random-init models, the real SmolLM2 tokenizer and
the real task files.

- the batched, left-padded, KV-reusing, segmented scorer equals a direct loop over log-softmax of
  one full forward per (context, continuation), for a Llama and a sliding-window Gemma 3;
- ``run_tasks`` accuracies / bits on 3 ARC-Challenge examples equal the hand-computed ones;
- bits per byte equals the summed token NLL over the UTF-8 bytes / ln 2, windows cover every
  token once, and batching does not change it;
- a random-init model is at chance level within 3 standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaForCausalLM,
)

from tests import tiny
from trainer.eval import evaluate_bpb, run_tasks
from trainer.eval.bpb import text_windows
from trainer.eval.engine import plan_batches
from trainer.eval.loglik import BatchLimits, TokenStats, encode_pair, score_items, text_encoder
from trainer.eval.tasks import TASKS, load


def _tiny_llama(vocab: int) -> LlamaForCausalLM:
    return tiny.tiny_llama(
        vocab,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )


def _tiny_gemma(vocab: int) -> Gemma3ForCausalLM:
    torch.manual_seed(1)
    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=16,  # far shorter than the contexts: the sliding cache is exercised
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    return Gemma3ForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_llama(smol_tok):
    return _tiny_llama(len(smol_tok))


# float64 copies: the scorer must then equal the direct loop to ~1e-10, so a mask, position or
# padding slip cannot hide inside float32 noise
@pytest.fixture(scope="session")
def llama64(smol_tok):
    return _tiny_llama(len(smol_tok)).double()


@pytest.fixture(scope="session")
def gemma64(smol_tok):
    return _tiny_gemma(len(smol_tok)).double()


def _reference(model, tok, context: str, continuation: str) -> tuple[float, bool, int]:
    """lm-eval's recipe by hand: ids of context+continuation after the context's ids, one full
    forward, then a loop over log-softmax rows."""
    ctx = tok(context)["input_ids"]
    whole = tok(context + continuation)["input_ids"]
    assert whole[: len(ctx)] == ctx
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0, len(ctx) - 1 :]  # rows that predict
        logp = torch.log_softmax(logits, dim=-1)
    total, greedy = 0.0, True
    for j in range(len(ctx), len(whole)):
        total += logp[j - len(ctx), whole[j]].item()
        greedy &= logp[j - len(ctx)].argmax().item() == whole[j]
    return total, greedy, len(whole) - len(ctx)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_scorer_matches_direct_loop(arch, llama64, gemma64, smol_tok, eval_data_ready):
    model = llama64 if arch == "llama" else gemma64
    enc = text_encoder(smol_tok)
    pairs = []  # (context, [continuations]) from three kinds of task
    for name in ("arc_easy", "winogrande", "mmlu"):
        ex = load(TASKS[name], limit=1)[0]
        if len(ex.contexts) == 1:
            pairs.append((ex.contexts[0], list(ex.continuations)))
        else:
            pairs += [(c, [ex.continuations[0]]) for c in ex.contexts]
    # three 5-shot questions of one subject: a long common prefix, run once per batch
    pairs += [(ex.contexts[0], list(ex.continuations)) for ex in load(TASKS["mmlu_5shot"])[:3]]
    stats = TokenStats()
    items = [encode_pair(enc, c, k, max_length=4096, stats=stats) for c, k in pairs]
    # tiny limits: several batches, left padding, segmented contexts and continuations
    limits = BatchLimits(max_items=2, max_tokens=96, cache_tokens=10**6)
    plans = plan_batches(items, limits)
    assert {p.shared > 100 for p in plans} == {True, False}  # both plans are exercised
    got = score_items(model, items, limits=limits)
    for (context, conts), scores in zip(pairs, got):
        for cont, s in zip(conts, scores):
            ref, greedy, n_tok = _reference(model, smol_tok, context, cont)
            assert s.logprob == pytest.approx(ref, abs=1e-9)
            assert (s.greedy, s.num_tokens) == (greedy, n_tok)
    assert max(len(i.context) for i in items) > 16  # longer than the sliding window
    assert stats.as_dict() == {
        "context_truncated": 0,
        "boundary_retokenized": 0,
        "skipped_too_long": 0,
    }


def test_run_tasks_matches_hand_metrics(llama64, smol_tok, eval_data_ready):
    res = run_tasks(llama64, smol_tok, ["arc_challenge"], limit=3, batch_size=2)
    res = res["arc_challenge"]
    examples = load(TASKS["arc_challenge"], limit=3)
    assert res["samples"]["id"] == [ex.id for ex in examples]
    for i, ex in enumerate(examples):
        refs = [_reference(llama64, smol_tok, ex.contexts[0], c) for c in ex.continuations]
        ll = np.array([r[0] for r in refs])
        nchar = np.array([len(c) for c in ex.continuations])
        ntok = np.array([r[2] for r in refs])
        assert res["samples"]["acc"][i] == int(ll.argmax() == ex.gold)
        assert res["samples"]["acc_norm"][i] == int((ll / nchar).argmax() == ex.gold)
        assert res["samples"]["acc_per_token"][i] == int((ll / ntok).argmax() == ex.gold)
        assert res["samples"]["bits"][i] == pytest.approx(-ll[ex.gold] / math.log(2), abs=1e-9)
    acc = res["metrics"]["acc"]
    assert acc["value"] == pytest.approx(np.mean(res["samples"]["acc"]))


TEXT = (
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune — café, naïve, 東京 — or to take arms.\n"
)


def test_bpb_equals_token_nll_over_bytes(gemma64, smol_tok):
    got = evaluate_bpb(gemma64, smol_tok, [TEXT], batch_size=2, max_length=4096)
    enc = text_encoder(smol_tok)
    ids = [enc.doc_start, *smol_tok(TEXT, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        logp = torch.log_softmax(gemma64(torch.tensor([ids])).logits[0], dim=-1)
    nats = -sum(logp[j - 1, ids[j]].item() for j in range(1, len(ids)))
    nbytes = len(TEXT.encode("utf-8"))
    assert nbytes > len(TEXT)  # multi-byte characters: bytes, not characters, divide
    assert got["bytes"] == nbytes and got["tokens"] == len(ids) - 1 and got["windows"] == 1
    assert got["nats"] == pytest.approx(nats, rel=1e-12)
    assert got["bpb"] == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-12)


@pytest.mark.parametrize("overlap", [0, 5])
def test_windows_cover_every_token_once(smol_tok, overlap):
    enc = text_encoder(smol_tok)
    ids = smol_tok(TEXT * 3, add_special_tokens=False)["input_ids"]
    items = text_windows(enc, ids, max_length=16, overlap=overlap)
    assert len(items) > 3
    assert [t for it in items for t in it.continuations[0]] == ids
    full = [enc.doc_start, *ids]
    pos = 1
    for k, it in enumerate(items):
        assert len(it.context) + len(it.continuations[0]) <= 16
        want = full[:1] if k == 0 else full[max(0, pos - 1 - overlap) : pos]
        assert it.context == want
        pos += len(it.continuations[0])


def test_bpb_independent_of_batching(llama64, smol_tok):
    texts = [TEXT, TEXT[:50], "Short.", TEXT * 2]
    a = evaluate_bpb(llama64, smol_tok, texts, batch_size=1, max_length=40)
    b = evaluate_bpb(llama64, smol_tok, texts, batch_size=4, max_length=40)
    assert a["windows"] == b["windows"] > len(texts)
    assert a["nats"] == pytest.approx(b["nats"], rel=1e-12)
    assert a["bytes"] == sum(len(t.encode()) for t in texts)


def test_random_model_is_at_chance(tiny_llama, smol_tok, eval_data_ready):
    checks = {  # task -> (metric, number of choices); metrics free of answer-length bias
        "boolq": ("acc", 2),
        "winogrande": ("acc", 2),
        "arc_easy": ("acc_per_token", 4),
        "openbookqa": ("acc_per_token", 4),
    }
    res = run_tasks(tiny_llama, smol_tok, list(checks), limit=100, batch_size=16)
    for task, (metric, k) in checks.items():
        m = res[task]["metrics"][metric]
        assert res[task]["n"] == 100
        assert abs(m["value"] - 1 / k) <= 3 * m["stderr"], (task, m)
        assert len(set(res[task]["samples"]["pred"])) > 1  # not stuck on one choice


def test_bpb_same_with_pipelines_tokenizer(tiny_llama, smol_tok, student_dir):
    """The trainer passes a ``pipelines`` Tokenizer: same ids, same start token, same BPB."""
    from tokenbridge.tokenizers import load_tokenizer

    texts = [TEXT, "Second text."]
    hf = evaluate_bpb(tiny_llama, smol_tok, texts, batch_size=2, max_length=64)
    ours = evaluate_bpb(tiny_llama, load_tokenizer(student_dir), texts, batch_size=2, max_length=64)
    assert ours["tokens"] == hf["tokens"] and ours["bytes"] == hf["bytes"]
    assert ours["bpb"] == pytest.approx(hf["bpb"], rel=1e-6)
