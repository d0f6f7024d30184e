"""Packed on-policy rollouts (`trainer.onpolicy.packed_rollouts`): the student's forward on
packed rows gives every rollout the losses and gradients of the padded forward, and nothing
leaks between the rollouts of a packed row.

Rollouts: fixed (no sampling noise), built from real text with the real tokenizers (SmolLM2
student; a SmolLM2-vocab teacher for kd_topk and opd_pg, a Gemma 3 one for xtoken and alm,
aligned on the fly as a run aligns them); completions of uneven length, some ending at EOS.
Models: tiny random ones of the real architectures. Teachers score the rollouts unpacked, as a
run's workers do (`used_inputs`); the losses run through the registry and `RolloutSource`.

- the packer: every rollout once, rows within the limit, positions restarting, each position
  of each rollout read back from where it landed;
- packed vs padded over the same rollouts: per-rollout losses within 1e-5, counts equal,
  the gradient of their total close, for kd_topk, xtoken, alm and opd_pg; the step's terms (`RolloutSource`,
  chunked logits, importance weights) equal in sum and count;
- changing one rollout's completion leaves every other rollout's loss, and the gradient of
  their loss, unchanged bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.tiny import tiny_llama
from tests.unit.test_loss_refs import random_t2s
from tests.unit.test_packing import tiny_gemma3
from tokenbridge.losses.alm import AlmConfig
from tokenbridge.losses.kd_topk import KDTopKConfig
from tokenbridge.losses.modes import MODES
from tokenbridge.losses.opd import OPDPGConfig
from tokenbridge.losses.ops.segments import AlignedBatch
from tokenbridge.losses.xtoken import XTokenConfig, XTokenTables
from tokenbridge.teacher.forward import teacher_forward
from tokenbridge.tokenizers import load_tokenizer
from trainer.data.microbatches import IGNORE
from trainer.loss_terms import KDTerm, kd_weights, used_inputs
from trainer.onpolicy.packed_rollouts import pack_rollouts, rollout_logits
from trainer.onpolicy.realign import TeacherView
from trainer.onpolicy.rollout_scoring import scoring_spec
from trainer.onpolicy.rollout_source import RolloutSource
from trainer.onpolicy.rollouts import build_batch, completion_rows
from trainer.onpolicy.sampling.sampler import Rollouts, SamplingConfig

# mode -> (teacher: "same" SmolLM2-vocab or "gemma", options), one term per mode
MODES_UNDER_TEST = {
    "kd_topk": ("same", KDTopKConfig(k=8)),
    "xtoken": ("gemma", XTokenConfig(k=8)),
    "alm": ("gemma", AlmConfig()),
    "opd_pg": ("same", OPDPGConfig()),
}
PROMPTS = ["In the beginning God created", "To be, or not to be,", "Now is the winter"]
COMPLETIONS = [
    " the heaven and the earth. And the earth was without form",
    " that is the question",
    " of our discontent made glorious summer by this sun of York; and all the clouds",
    " and void",
    " whether 'tis nobler in the mind to suffer",
]
ROW_TOKENS = 48


def _rollouts(s_tok, *, reverse: int | None = None) -> Rollouts:
    """Five rollouts of three prompts, uneven; those of even index end at EOS. ``reverse``: that
    rollout's completion (before its EOS) in reverse order: other tokens, the same length."""
    prompts, completions, stopped = [], [], []
    for i, text in enumerate(COMPLETIONS):
        prompts.append([s_tok.bos_id, *s_tok.encode(PROMPTS[i % 3]).ids.tolist()])
        ids = s_tok.encode(text).ids.tolist()
        if i == reverse:
            ids = ids[::-1]
        stop = i % 2 == 0
        completions.append(ids + [s_tok.eos_id] if stop else ids)
        stopped.append(stop)
    return Rollouts(prompts, completions, stopped, prompt_index=[i % 3 for i in range(5)])


@pytest.fixture(scope="module")
def setup(student_dir, teacher_dir):
    s_tok, g_tok = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    vs, vt = s_tok.vocab_size, g_tok.vocab_size
    student = tiny_llama(vs, seed=1, max_position_embeddings=256)
    teachers = {"same": tiny_llama(vs, seed=3, max_position_embeddings=256),
                "gemma": tiny_gemma3(vt, seed=2)}  # fmt: skip
    with torch.no_grad():
        for m in (student, *teachers.values()):  # peaked: divergences above fp32 noise
            m.lm_head.weight.mul_(40.0)
    ids, w = random_t2s(0, Vt=vt, vs=vs, k=3)
    tables = XTokenTables.from_arrays(ids, w, student_vocab_size=vs)
    views = {"same": None, "gemma": TeacherView(g_tok, 512, stop_id=g_tok.eos_id)}
    terms = []
    for j, (mode, (teacher, opts)) in enumerate(MODES_UNDER_TEST.items()):
        record = MODES[mode]
        t_tables = tables if mode == "xtoken" else None
        t_vocab = vt if teacher == "gemma" else vs
        spec = scoring_spec(record.teacher_spec(opts, t_tables, teacher_vocab_size=t_vocab))
        terms.append(KDTerm(j, mode, mode, opts, spec, t_tables, vs, 1.0 + j))
    return {"s_tok": s_tok, "student": student, "teachers": teachers, "views": views,
            "terms": terms}  # fmt: skip


def _batch(setup, r: Rollouts, *, packed: bool, pad_to_multiple: int = 8):
    """The rollouts as one microbatch, packed or not, and each term's prep and teacher
    outputs; a wide ``pad_to_multiple`` keeps every side's width when a completion changes."""
    views = [setup["views"][t] for t, _ in MODES_UNDER_TEST.values()]
    b = build_batch(
        r,
        list(range(len(r))),
        student=setup["s_tok"],
        teachers=views,
        want_cols=[False] * len(views),
        pad_id=0,
        pad_to_multiple=pad_to_multiple,
    )
    if packed:
        lens = b.attention_mask_BT.sum(1).tolist()
        b.packed = pack_rollouts(b.input_ids_BT, lens, row_tokens=ROW_TOKENS, buffer=64, pad_id=0)
    preps, outs = [], []
    for j, term in enumerate(setup["terms"]):
        prep = term.record.prepare(b.aligned[j], b.targets_BT)
        inputs = b.teacher_inputs[j]
        done = completion_rows(b.aligned[j], inputs["input_ids"].shape[1])
        inputs = used_inputs(term.record, prep, inputs, completion=done)
        teacher = setup["teachers"][MODES_UNDER_TEST[term.mode][0]]
        with torch.no_grad():
            outs.append(teacher_forward(teacher, inputs["input_ids"], inputs["attention_mask"],
                                        spec=term.spec, columns=term.columns(), chunk=16,
                                        used_BU=inputs["used_mask"]))  # fmt: skip
        preps.append(prep)
    return b, preps, outs


def _only(a: AlignedBatch, rollouts: list[int]) -> AlignedBatch:
    """``a`` with the chunks of every rollout not in `rollouts` removed."""
    keep_B1 = torch.isin(torch.arange(a.student_ids.shape[0])[:, None], torch.tensor(rollouts))
    return dataclasses.replace(
        a,
        student_chunk=torch.where(keep_B1, a.student_chunk, -1),
        teacher_chunk=torch.where(keep_B1, a.teacher_chunk, -1),
        n_chunks=torch.where(keep_B1[:, 0], a.n_chunks, 0),
    )


def _term_loss(term, j: int, b, outs, logits, rollouts: list[int]):
    """Term j's loss over `rollouts` only (a chunk mode reads the chunks, not the targets)."""
    keep_B1 = torch.isin(torch.arange(b.input_ids_BT.shape[0])[:, None], torch.tensor(rollouts))
    targets = torch.where(keep_B1, b.targets_BT, IGNORE)
    prep = term.record.prepare(_only(b.aligned[j], rollouts), targets)
    out = term.loss(logits, outs[j], prep)
    assert int(out.count) == term.count(prep)
    return out


def _per_rollout(setup, b, outs, *, grad_of: list[int], chunk: int = 0):
    """Per term and rollout: (loss sum, count); per term, the gradient over the student's
    parameters of the loss of the rollouts in `grad_of` (one backward per term: a rollout
    leaking into another's loss shows in it); and the student's logits in the rollouts'
    layout."""
    params = list(setup["student"].parameters())
    logits = rollout_logits(setup["student"], b, chunk=chunk)
    got, grads = {}, {}
    for j, term in enumerate(setup["terms"]):
        with torch.no_grad():
            for d in range(b.input_ids_BT.shape[0]):
                out = _term_loss(term, j, b, outs, logits.detach(), [d])
                got[(term.mode, d)] = (out.sum, int(out.count))
        out = _term_loss(term, j, b, outs, logits, grad_of)
        g = torch.autograd.grad(out.sum, params, retain_graph=True, allow_unused=True)
        grads[term.mode] = [x for x in g if x is not None]
    return logits, got, grads


def test_pack_rollouts_puts_each_rollout_once_and_reads_it_back(setup):
    b, _, _ = _batch(setup, _rollouts(setup["s_tok"]), packed=True)
    p, lens = b.packed, b.attention_mask_BT.sum(1).tolist()
    assert sorted(d for row in p.rows for d in row) == list(range(len(lens)))
    assert len(p.rows) < len(lens) and max(len(row) for row in p.rows) >= 2  # shared rows
    assert all(sum(lens[d] for d in row) <= ROW_TOKENS for row in p.rows)
    # fewer positions than the padded rows: the padding the rollouts' uneven ends left
    assert p.positions < len(lens) * max(lens)
    real_BT = b.attention_mask_BT > 0
    flat_ids, flat_pos = p.input_ids_RP.reshape(-1), p.position_ids_RP.reshape(-1)
    assert torch.equal(flat_ids[p.index_BT][real_BT], b.input_ids_BT[real_BT])
    t_BT = torch.arange(b.input_ids_BT.shape[1]).expand_as(b.input_ids_BT)
    assert torch.equal(flat_pos[p.index_BT][real_BT], t_BT[real_BT])  # restarting per rollout
    # a padding position reads its own rollout's last token
    last_B = p.index_BT[torch.arange(len(lens)), torch.tensor(lens) - 1]
    assert torch.equal(p.index_BT[~real_BT], last_B[:, None].expand_as(p.index_BT)[~real_BT])
    with pytest.raises(ValueError, match="does not fit a packed row"):
        pack_rollouts(b.input_ids_BT, lens, row_tokens=max(lens) - 1, buffer=8, pad_id=0)


def test_packed_rollouts_never_compute_more_positions_than_padded_rows():
    # the fullest rows (limit 504) would be [200, 180, 120] and [150]: 2 x 504 positions
    p = pack_rollouts(torch.zeros(4, 200, dtype=torch.long), [200, 180, 150, 120],
                      row_tokens=504, buffer=8, pad_id=0)  # fmt: skip
    assert p.positions <= 4 * 200 and p.positions < 2 * 504
    g = np.random.default_rng(0)
    for _ in range(50):
        lens = g.integers(1, 120, size=int(g.integers(1, 12))).tolist()
        ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
        row_tokens = int(g.integers(max(lens), 400))
        p = pack_rollouts(ids, lens, row_tokens=row_tokens, buffer=64, pad_id=0)
        assert p.positions <= len(lens) * -(-max(lens) // 8) * 8, lens
        assert sorted(d for row in p.rows for d in row) == list(range(len(lens)))
        assert all(sum(lens[d] for d in row) <= row_tokens for row in p.rows)


def test_packed_and_padded_rollouts_give_the_same_losses(setup):
    r = _rollouts(setup["s_tok"])
    padded, _, outs = _batch(setup, r, packed=False)
    packed, _, outs_p = _batch(setup, r, packed=True)
    every = list(range(len(r)))
    logits_w, want, want_g = _per_rollout(setup, padded, outs, grad_of=every)
    logits_g, got, got_g = _per_rollout(setup, packed, outs_p, grad_of=every)
    real = padded.attention_mask_BT > 0
    assert torch.allclose(logits_g[real], logits_w[real], rtol=1e-5, atol=1e-5)
    for j, term in enumerate(setup["terms"]):
        counts = [want[(term.mode, d)][1] for d in range(len(r))]
        assert all(c > 0 for c in counts), (term.mode, counts)
        # the rollouts' terms are the batch's: sum and count, packed and padded
        for b, o, per, logits in ((padded, outs, want, logits_w), (packed, outs_p, got, logits_g)):
            whole = term.loss(logits, o[j], term.record.prepare(b.aligned[j], b.targets_BT))
            assert int(whole.count) == sum(per[(term.mode, d)][1] for d in range(len(r)))
            parts = sum(per[(term.mode, d)][0].double() for d in range(len(r)))
            assert torch.allclose(whole.sum.detach().double(), parts, rtol=1e-5), term.mode
        for d in range(len(r)):
            (s_w, n_w), (s_g, n_g) = want[(term.mode, d)], got[(term.mode, d)]
            assert n_w == n_g, (term.mode, d)
            assert torch.allclose(s_g, s_w, rtol=1e-5, atol=1e-5), (term.mode, d, float(s_g - s_w))
        assert len(got_g[term.mode]) == len(want_g[term.mode]) > 0
        for x, y in zip(got_g[term.mode], want_g[term.mode]):
            # fp32 sums over different row layouts: relative to the gradient's size
            assert float((x - y).norm()) <= 1e-5 * float(y.norm()), term.mode


def test_the_step_terms_are_the_same_packed_or_padded(setup):
    """`RolloutSource` as a step runs it: chunked logits (`HeadLogits` gathered back), each
    position's gradient weighted by an importance ratio (behaviour log-probs given)."""
    r = _rollouts(setup["s_tok"])
    student, terms = setup["student"], setup["terms"]
    params = list(student.parameters())
    results = {}
    for packed in (False, True):
        b, preps, outs = _batch(setup, r, packed=packed)
        g = torch.Generator().manual_seed(0)
        behaviour_BT = -3.0 * torch.rand(b.targets_BT.shape, generator=g)
        b.behaviour_BT = torch.where(b.targets_BT >= 0, behaviour_BT, 0.0)
        source = RolloutSource(
            r, [(b, preps)], [outs], model=student, terms=terms, mixture=False,
            weights=kd_weights(terms), sampling=SamplingConfig(), ratio_clip=2.0,
            logits_chunk=16, tp_group=None, vocab_size=setup["s_tok"].vocab_size,
            loader=None, device=torch.device("cpu"),
        )  # fmt: skip
        with source.microbatch(0) as t:
            sums = torch.stack([o.sum for o in t.kd])
            counts = [int(o.count) for o in t.kd]
            total = source.combine(None, [o.sum for o in t.kd])
            grads = torch.autograd.grad(total, params)
        positions = source.step_sums()["positions"]
        results[packed] = (sums.detach(), counts, grads, positions, source.ratio["n"])
    (s_w, n_w, g_w, pos_w, ratio_w), (s_g, n_g, g_g, pos_g, ratio_g) = results[False], results[True]
    assert n_g == n_w and all(n > 0 for n in n_w) and ratio_g == ratio_w > 0
    assert torch.allclose(s_g, s_w, rtol=1e-5, atol=1e-5), (s_g - s_w).tolist()
    for x, y in zip(g_g, g_w):
        assert torch.allclose(x, y, rtol=1e-3, atol=1e-5)
    assert pos_g < pos_w  # the packed rows compute fewer positions


def test_changing_one_rollout_changes_no_other_rollout_in_its_row(setup):
    s_tok = setup["s_tok"]
    b, _, outs = _batch(setup, _rollouts(s_tok), packed=True, pad_to_multiple=32)
    c, _, outs_c = _batch(setup, _rollouts(s_tok, reverse=1), packed=True, pad_to_multiple=32)
    assert b.packed.rows == c.packed.rows  # the same lengths: the same rows
    shared = next(row for row in b.packed.rows if 1 in row)
    assert len(shared) >= 2  # rollout 1 shares its packed row
    assert not torch.equal(b.packed.input_ids_RP, c.packed.input_ids_RP)
    for k in range(len(outs)):  # every teacher's rows keep their widths
        assert b.aligned[k].teacher_ids.shape == c.aligned[k].teacher_ids.shape
    kept = [0, 2, 3, 4]
    logits_a, a, g_a = _per_rollout(setup, b, outs, grad_of=kept)
    logits_c, got, g_c = _per_rollout(setup, c, outs_c, grad_of=kept)
    row_BT = torch.arange(b.input_ids_BT.shape[0])[:, None].expand_as(b.input_ids_BT)
    others = (b.attention_mask_BT > 0) & (row_BT != 1)
    assert torch.equal(logits_a[others], logits_c[others])  # bit for bit
    assert not torch.equal(logits_a[row_BT == 1], logits_c[row_BT == 1])
    for term in setup["terms"]:
        for d in kept:
            (s_a, n_a), (s_c, n_c) = a[(term.mode, d)], got[(term.mode, d)]
            assert n_a == n_c and torch.equal(s_a, s_c), (term.mode, d)
        # the gradient of the other rollouts' loss: not a bit from rollout 1
        x, y = g_a[term.mode], g_c[term.mode]
        assert len(x) == len(y) > 0 and all(torch.equal(u, v) for u, v in zip(x, y)), term.mode
        assert not torch.equal(a[(term.mode, 1)][0], got[(term.mode, 1)][0]), term.mode
    assert np.array_equal(np.sort(np.concatenate(b.packed.rows)), np.arange(5))
