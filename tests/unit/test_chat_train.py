"""The trainer on conversation shards: masked CE and every KD mode equal a dense reference that
applies the train masks by hand.

Shards: shipped example conversations with the real tokenizers (student SmolLM2 with its own
template; teacher 0 Gemma 3 with the shipped ``gemma`` template; teacher 1 SmolLM2 itself, for
the same-tokenizer ``kd_topk``), written by the align job's pure steps. Models: tiny random
Llamas with the real vocabulary sizes.

The trainer's path: the loader's target mask (`trainer.data.microbatches.train_targets`), the registry's
``prepare`` / ``count`` / ``loss`` and ``teacher_rows``, and the teacher computing outputs at
those rows only (`teacher_forward(used_BU=...)`: NaN elsewhere, so a loss reading any other row
would not be finite). The reference: from the shard columns alone, by hand — CE over the
positions whose next token has a train code; kd_topk (`dense_kd_topk`, float64)
at those positions; for the chunk modes, the chunks whose every student token is trained, of a
text kind, given to the mode's function on an index with every other chunk blanked out, with
full-sequence teacher outputs, plus the end-of-turn term written out from dense log-softmaxes
(KL of the two Bernoulli "stop" probabilities). Values and student-logit gradients agree.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.e2e.helpers import example_rows, write_chat_shards
from tests.tiny import tiny_llama
from tests.unit.test_loss_refs import NEG, masked_logp, random_t2s, ref_bin
from tokenbridge.formats import shard_schema
from tokenbridge.formats.shards import open_shards
from tokenbridge.losses import AlignedBatch, index_chunks, normalize
from tokenbridge.losses.alm import AlmConfig, alm
from tokenbridge.losses.gold import GoldConfig, GoldTables, gold
from tokenbridge.losses.kd_topk import KDTopKConfig
from tokenbridge.losses.modes import MODES
from tokenbridge.losses.xtoken import XTokenConfig, XTokenTables, xtoken
from tokenbridge.tokenizers import load_tokenizer
from trainer.config.schema import LossConfig
from trainer.data.microbatches import IGNORE, collate
from trainer.data.shard_reader import ShardReader
from trainer.eval import trained_bpb
from trainer.loss_terms import ce_term, combine_terms
from trainer.teacher.model_program import teacher_forward

MODE_FUNCS = {"xtoken": xtoken, "gold": gold, "alm": alm}


@pytest.fixture(scope="module", params=["assistant", "all"])
def batch(request, tmp_path_factory, student_dir, teacher_dir):
    train_on = request.param
    rows = example_rows(2) + example_rows(1, fmt="prompt_completion")
    out = write_chat_shards(
        tmp_path_factory.mktemp(f"chat_{train_on}"),
        rows,
        student_dir=student_dir,
        teachers=[(teacher_dir, "gemma"), (student_dir, None)],
        train_on=train_on,
    )
    s_tok, t_tok = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    reader = ShardReader(open_shards(out), max_student_tokens=2048)
    shard_rows = [reader.row(i) for i in range(reader.num_rows)]
    mb = collate(shard_rows, student_pad=0, teacher_pads=[0, 0], pad_to_multiple=8)
    student = tiny_llama(s_tok.vocab_size, seed=1, max_position_embeddings=1024)
    teachers = [
        tiny_llama(t_tok.vocab_size, seed=2, max_position_embeddings=1024),
        tiny_llama(s_tok.vocab_size, seed=3, max_position_embeddings=1024),
    ]
    with torch.no_grad():
        # peaked distributions: divergences well above fp32 noise
        for model in (student, *teachers):
            model.lm_head.weight.mul_(40.0)
        s_logits = student(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits
        # Gemma's [B, U, 262144] logits are never held: its hidden states, and the lm_head on
        # the few rows the hand reference reads
        t0_hidden = teachers[0].model(**mb.teacher_inputs(0)).last_hidden_state
        t1_logits = teachers[1](**mb.teacher_inputs(1)).logits
    return {
        "train_on": train_on,
        "rows": shard_rows,
        "mb": mb,
        "student": student,
        "token_lengths": s_tok.token_lengths,
        "s_logits": s_logits,
        "teachers": teachers,
        "t0_logits": lambda b, j: teachers[0].lm_head(t0_hidden[b, j]).detach(),
        "t1_logits": t1_logits,
        "vs": s_tok.vocab_size,
        "vt": [t_tok.vocab_size, s_tok.vocab_size],
    }


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def _grad(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(value, x)
    return g


def _nll_by_hand(s, rows, vs: int, *, trained=lambda codes: codes > 0):
    """(sum, count) over the positions j - 1 whose next token j is `trained` (by its code) of
    -log q(token j): a float64 log-softmax with the padded vocabulary masked, at those
    positions only, in one gather (one autograd node, not one per position)."""
    at = [(b, j) for b, r in enumerate(rows) for j in np.flatnonzero(trained(r["train"])) if j > 0]
    b, j = (torch.tensor(x, dtype=torch.int64) for x in zip(*at))
    ids = torch.tensor([int(rows[x]["student_ids"][y]) for x, y in at])
    x = s[b, j - 1].double()
    x = x.masked_fill(torch.arange(x.shape[-1]) >= vs, NEG)
    return -torch.log_softmax(x, -1)[torch.arange(len(at)), ids].sum(), len(at)


def test_shard_codes_mark_the_trained_contents(batch):
    for r in batch["rows"]:
        codes = r["train"]
        if batch["train_on"] == "all":
            assert (codes > 0).all()
        else:  # the assistant contents (1) and their end-of-turn runs (2), nothing else
            assert set(np.unique(codes)) == {
                shard_schema.TRAIN_NONE,
                shard_schema.TRAIN_CONTENT,
                shard_schema.TRAIN_END_OF_TURN,
            }
            assert codes[0] == shard_schema.TRAIN_NONE
        # the teachers' codes mark their own tokens of the same contents
        assert r["teachers"][0]["train"].max() == codes.max()
        assert np.array_equal(r["teachers"][1]["train"], codes)  # same tokenizer and template


def test_masked_ce_equals_the_hand_reference(batch):
    s = _leaf(batch["s_logits"])
    out = ce_term(s, batch["mb"], vocab_size=batch["vs"])
    ref, n = _nll_by_hand(s, batch["rows"], batch["vs"])
    assert int(out.count) == n > 0
    assert torch.allclose(out.sum.double(), ref, rtol=1e-6)
    assert torch.allclose(_grad(out.sum, s), _grad(ref, s), atol=1e-6)
    targets = batch["mb"].targets_BT
    assert int((targets != IGNORE).sum()) == n


def test_trained_bpb_counts_the_trained_contents_only(batch):
    rows, vs = batch["rows"], batch["vs"]
    for r in rows:
        content = np.flatnonzero(r["train"] == shard_schema.TRAIN_CONTENT)
        assert content[0] > 0  # every content token is predicted (the rendering opens with markup)
        # the shard's trained bytes are the bytes of exactly these tokens (no loose tokens)
        assert r["trained_bytes"] == int(batch["token_lengths"][r["student_ids"][content]].sum())
    nats, n = _nll_by_hand(
        batch["s_logits"], rows, vs, trained=lambda c: c == shard_schema.TRAIN_CONTENT
    )
    nats = float(nats)
    nbytes = sum(r["trained_bytes"] for r in rows)
    got = trained_bpb(batch["student"], [(r["student_ids"], r["train"], r["trained_bytes"])
                                         for r in rows], vocab_size=vs, batch_size=2)  # fmt: skip
    assert got["tokens"] == n and got["bytes"] == nbytes > 0
    assert got["bpb"] == pytest.approx(nats / (np.log(2) * nbytes), rel=1e-5)


def dense_kd_topk(s_BTV, t_BTV, mask_BT, *, vs: int, k: int) -> torch.Tensor:
    """Forward KL over the teacher's top-k plus a tail bucket, summed over the masked positions,
    in float64 from full log-softmaxes (`test_loss_refs.ref_kd_topk`, one row at a time, is
    the same formula; this is its vectorised form, for the ~1000 positions here)."""

    def logp(x):
        x = x[mask_BT].double().clone()
        x[:, vs:] = NEG
        return torch.log_softmax(x, -1)

    lp, lq = logp(t_BTV), logp(s_BTV)
    ids = torch.topk(lp, k, dim=-1).indices
    p, q = lp.gather(1, ids).exp(), lq.gather(1, ids).exp()
    p = torch.cat([p, 1 - p.sum(1, keepdim=True)], 1)
    q = torch.cat([q, (1 - q.sum(1, keepdim=True)).clamp(min=0)], 1)
    return torch.where(p > 0, p * (p.log() - q.log()), 0.0).sum()


def _tables(mode: str, *, vs: int, vt: int):
    if mode == "xtoken":
        ids, w = random_t2s(0, Vt=vt, vs=vs, k=3)
        return XTokenTables.from_arrays(ids, w, student_vocab_size=vs)
    if mode == "gold":
        g = np.random.default_rng(0)
        exact = np.where(g.random(vt) < 0.02, g.integers(0, vs, vt), -1)  # ~5k pairs
        return GoldTables.from_exact_map(exact, teacher_vocab_size=vt, student_vocab_size=vs)
    return None


OPTIONS = {"xtoken": XTokenConfig(k=8), "gold": GoldConfig(uld_width=64), "alm": AlmConfig()}


def _hand_chunks(rows, kinds_of):
    """Per row, the chunks trained by hand (every student token has a code > 0, none at
    position 0), split into text chunks and end-of-turn / open-marker pairs."""
    text, turns = [], []
    for r in rows:
        t = r["teachers"][0]
        sc, codes = r["teachers"][0]["student_chunk"], r["train"]
        ok = set()
        for c in range(int(t["n_chunks"])):
            pos = np.flatnonzero(sc == c)
            if pos.size and pos[0] > 0 and (codes[pos] > 0).all():
                ok.add(c)
        text.append({c for c in ok if kinds_of(r)[c] < shard_schema.CHUNK_OPEN})
        turns.append({c for c in ok if kinds_of(r)[c] >= shard_schema.CHUNK_OPEN})
    return text, turns


def _blanked(a: AlignedBatch, keep: list[set]) -> AlignedBatch:
    """The batch with every chunk outside `keep` (per row) turned into no chunk (-1)."""

    def blank(chunk_BT):
        out = chunk_BT.clone()
        for b, chunks in enumerate(keep):
            row = out[b]
            row[~torch.isin(row, torch.tensor(sorted(chunks) or [-2]))] = -1
        return out

    return dataclasses.replace(
        a,
        student_chunk=blank(a.student_chunk),
        teacher_chunk=blank(a.teacher_chunk),
        chunk_kind=None,
    )


def _eot_by_hand(s, t_logits, rows, turns, *, vs, vt):
    """sum over the trained turn-marker pairs of KL(Bern(p_t) || Bern(p_s)), p = the chain
    probability of each side's run, from dense log-softmaxes (`t_logits(b, j)`: the teacher's
    logits at row b, position j)."""
    total, n = torch.zeros((), dtype=torch.float64), 0
    for b, (r, chunks) in enumerate(zip(rows, turns)):
        t = r["teachers"][0]
        for c in sorted(chunks):
            sp = np.flatnonzero(t["student_chunk"] == c)
            tp = np.flatnonzero(t["chunk"] == c)
            ls = sum(masked_logp(s[b, j - 1], vs)[r["student_ids"][j]] for j in sp)
            lt = sum(masked_logp(t_logits(b, j - 1), vt)[t["ids"][j]] for j in tp)
            total = total + ref_bin(lt, ls, "kl")
            n += 1
    return total, n


@pytest.mark.parametrize("mode", ["xtoken", "gold", "alm"])
def test_chunk_modes_equal_the_hand_masked_reference(batch, mode):
    mb, rows, vs, vt = batch["mb"], batch["rows"], batch["vs"], batch["vt"][0]
    record, opts = MODES[mode], OPTIONS[mode]
    tables = _tables(mode, vs=vs, vt=vt)
    spec = record.spec_for(record.teacher_spec(opts, tables, teacher_vocab_size=vt), turns=True)
    cols = record.columns(tables)
    # the trainer's path: prepare from the masked targets, teacher outputs at the used rows only
    prep = record.prepare(mb.aligned[0], mb.targets_BT)
    t_in = mb.teacher_inputs(0)
    used = record.teacher_rows(prep, t_in["input_ids"].shape[1])
    with torch.no_grad():
        outs = teacher_forward(batch["teachers"][0], t_in["input_ids"], t_in["attention_mask"],
                               spec=spec, columns=cols, chunk=16, used_BU=used)  # fmt: skip
    unused = ~used & (t_in["attention_mask"] > 0)
    # even with train_on=all, rows predicting scaffolding (in no chunk) are unused
    assert unused.any() and used.any()
    for name, v in outs.tensors().items():
        if v.is_floating_point():
            assert torch.isnan(v[unused]).all(), name  # never computed, never read
    s = _leaf(batch["s_logits"])
    fast = record.loss(s, outs, prep, tables=tables, vocab_size=vs, config=opts)
    assert record.count(prep) == int(fast.count)
    # the reference: chunks chosen by hand, full-sequence teacher outputs
    text, turns = _hand_chunks(rows, lambda r: r["teachers"][0]["chunk_kind"])
    with torch.no_grad():  # every position (the dense path)
        dense = teacher_forward(batch["teachers"][0], t_in["input_ids"], t_in["attention_mask"],
                                spec=spec, columns=cols, chunk=16)  # fmt: skip
    ref_text = MODE_FUNCS[mode](s, dense, index_chunks(_blanked(mb.aligned[0], text)),
                                vocab_size=vs, config=opts,
                                **({"tables": tables} if tables is not None else {}))  # fmt: skip
    eot, n_eot = _eot_by_hand(s, batch["t0_logits"], rows, turns, vs=vs, vt=vt)
    assert n_eot > 0 and int(ref_text.count) > 0
    assert int(fast.count) == int(ref_text.count) + n_eot
    ref = ref_text.sum + eot
    assert torch.allclose(fast.sum.double(), ref.double(), rtol=1e-5, atol=1e-7), (fast.sum, ref)
    assert torch.allclose(fast.metrics["eot_sum"].double(), eot, rtol=1e-5, atol=1e-9)
    assert torch.allclose(_grad(fast.sum, s), _grad(ref, s), rtol=1e-4, atol=1e-9)


# train_on=all (every position) is covered by the CE and chunk-mode tests; 3x slower here
@pytest.mark.parametrize("batch", ["assistant"], indirect=True)
def test_kd_topk_and_two_teachers_equal_the_hand_reference(batch):
    mb, rows, vs = batch["mb"], batch["rows"], batch["vs"]
    kd, opts = MODES["kd_topk"], KDTopKConfig(k=8)
    spec = kd.teacher_spec(opts, None, teacher_vocab_size=vs)
    prep = kd.prepare(mb.aligned[1], mb.targets_BT)
    t_in = mb.teacher_inputs(1)
    with torch.no_grad():
        outs = teacher_forward(batch["teachers"][1], t_in["input_ids"], t_in["attention_mask"],
                               spec=spec, columns=None, chunk=16,
                               used_BU=kd.teacher_rows(prep, t_in["input_ids"].shape[1]))  # fmt: skip
    s = _leaf(batch["s_logits"])
    fast = kd.loss(s, outs, prep, tables=None, vocab_size=vs, config=opts)
    mask = torch.zeros(mb.targets_BT.shape, dtype=torch.bool)
    for b, r in enumerate(rows):
        trained = np.flatnonzero(r["train"][1:] > 0)  # position j predicts token j + 1
        mask[b, trained] = True
    ref = dense_kd_topk(s, batch["t1_logits"], mask, vs=vs, k=8)
    assert kd.count(prep) == int(fast.count) == int(mask.sum())
    assert torch.allclose(fast.sum.double(), ref, rtol=1e-5), float(fast.sum.double() - ref)
    assert torch.allclose(_grad(fast.sum, s), _grad(ref, s), rtol=1e-4, atol=1e-9)

    # two teachers (alm on Gemma, kd_topk on SmolLM2) and CE, combined as the loop does: each
    # term over its own masked count, teachers weighted
    alm_rec = MODES["alm"]
    a_prep = alm_rec.prepare(mb.aligned[0], mb.targets_BT)
    a_spec = alm_rec.spec_for(alm_rec.teacher_spec(AlmConfig(), None, teacher_vocab_size=batch["vt"][0]), turns=True)  # fmt: skip
    t0 = mb.teacher_inputs(0)
    with torch.no_grad():
        a_outs = teacher_forward(batch["teachers"][0], t0["input_ids"], t0["attention_mask"],
                                 spec=a_spec, columns=None, chunk=16,
                                 used_BU=alm_rec.teacher_rows(a_prep, t0["input_ids"].shape[1]))  # fmt: skip
    s2 = _leaf(batch["s_logits"])
    a_fast = alm_rec.loss(s2, a_outs, a_prep, tables=None, vocab_size=vs, config=AlmConfig())
    k_fast = kd.loss(s2, outs, prep, tables=None, vocab_size=vs, config=opts)
    ce_fast = ce_term(s2, mb, vocab_size=vs)
    counts = torch.tensor([float(o.count) for o in (ce_fast, a_fast, k_fast)], dtype=torch.float64)
    weights = torch.tensor([0.25, 0.75], dtype=torch.float64)
    cfg = LossConfig(mode="alm", ce_weight=0.5, kd_weight=2.0)
    ce_v, a_v, k_v = (normalize(o, c) for o, c in zip((ce_fast, a_fast, k_fast), counts))
    total = combine_terms(cfg.combine_config(), ce_v, [a_v, k_v], weights=weights, scale=None)
    text, turns = _hand_chunks(rows, lambda r: r["teachers"][0]["chunk_kind"])
    with torch.no_grad():
        a_dense = teacher_forward(batch["teachers"][0], t0["input_ids"], t0["attention_mask"],
                                  spec=a_spec, columns=None, chunk=16)  # fmt: skip
    a_ref = alm(s2, a_dense, index_chunks(_blanked(mb.aligned[0], text)), vocab_size=vs, config=AlmConfig())  # fmt: skip
    eot, n_eot = _eot_by_hand(s2, batch["t0_logits"], rows, turns, vs=vs, vt=batch["vt"][0])
    ce_ref, n_ce = _nll_by_hand(s2, rows, vs)
    kd_ref = 0.25 * (a_ref.sum + eot) / (int(a_ref.count) + n_eot) + 0.75 * dense_kd_topk(
        s2, batch["t1_logits"], mask, vs=vs, k=8
    ) / int(mask.sum())
    want = 2.0 * kd_ref + 0.5 * ce_ref / n_ce
    assert torch.allclose(total.double(), want.double(), rtol=1e-5)
    assert torch.allclose(_grad(total, s2), _grad(want, s2), rtol=1e-4, atol=1e-9)
