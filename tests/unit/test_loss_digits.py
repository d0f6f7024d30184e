"""The numbers ablation, with real tokenizers: SmolLM2 (student) spells digits one by one,
llama-bpe (teacher) groups up to three. What does each mode do on number chunks?

Both models are "oracles" that put 0.9 on the realised next token (the rest spread evenly), so
every divergence should ideally be ~0 and no mode should push the student off the right digit.
The sign of d loss / d logit(correct token) at each student position tells what a gradient
step does there: > 0 lowers the correct digit (suppression), < 0 raises it, 0 = no term.
Findings (docs/losses.md, "Numbers"): ce and alm raise every digit; xtoken gives one term per
chunk start (inner digits of a 3:1 chunk get none) and is ~0 on number chunks with bucketed
first-token rows, but lowers the right first digit with the projection's weighted rows; gold
lowers the right digits of every multi-digit chunk with a rest bucket and gives them no signal
without one (the X-Token failure); kd_topk refuses the pair.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenbridge.alignment import align
from tokenbridge.losses import (
    AlmConfig,
    GoldConfig,
    GoldTables,
    KDTopKConfig,
    XTokenConfig,
    XTokenTables,
    alm,
    alm_teacher_spec,
    ce,
    collate_aligned,
    gold,
    gold_teacher_spec,
    index_chunks,
    kd_topk,
    kd_topk_teacher_spec,
    shift_targets,
    teacher_outputs_from_logits,
    xtoken,
    xtoken_teacher_spec,
)
from tokenbridge.projection import build_projection
from tokenbridge.tokenizers import load_tokenizer

pytestmark = pytest.mark.assets
TEXT = "In 2024 we sold 1234567 apples and 365 pears."
P_TRUE = 0.9


def _oracle(ids: list[int], vocab: int) -> torch.Tensor:
    """[1, n, vocab] logits putting P_TRUE on each realised next token."""
    logit = math.log(P_TRUE * (vocab - 1) / (1 - P_TRUE))
    x = torch.zeros(1, len(ids), vocab)
    for i in range(len(ids) - 1):
        x[0, i, ids[i + 1]] = logit
    return x


@pytest.fixture(scope="module")
def case(student_dir, vocab_fixture):
    s_tok = load_tokenizer(student_dir)
    t_tok = load_tokenizer(vocab_fixture("llama-bpe"))
    es, et = s_tok.encode(TEXT), t_tok.encode(TEXT)
    a = align(es, et)
    row = {
        "student_ids": [s_tok.bos_id, *es.ids.tolist(), s_tok.eos_id],
        "teacher0_ids": [t_tok.bos_id, *et.ids.tolist(), t_tok.eos_id],
        "teacher0_student_chunk": [-1, *a.student_chunk.tolist(), -1],
        "teacher0_chunk": [-1, *a.teacher_chunk.tolist(), -1],
        "teacher0_n_chunks": a.n_chunks,
    }
    batch = collate_aligned([row], 0)
    proj = build_projection(t_tok, s_tok, k=8)
    return s_tok, t_tok, row, batch, proj


def _grads(case, run):
    """d loss / d logit(correct next token) per student position, and the loss output."""
    s_tok, t_tok, row, batch, proj = case
    student = _oracle(row["student_ids"], s_tok.vocab_size).requires_grad_()
    teacher = _oracle(row["teacher0_ids"], t_tok.vocab_size)
    out = run(student, teacher, batch, proj, s_tok, t_tok)
    (g,) = torch.autograd.grad(out.sum, student)
    ids = row["student_ids"]
    return [float(g[0, i, ids[i + 1]]) for i in range(len(ids) - 1)], out


def _digit_positions(case):
    """Student positions predicting a digit, split into chunk starts and inner positions."""
    s_tok, _, row, _, _ = case
    ids, ch = row["student_ids"], row["teacher0_student_chunk"]
    starts, inner, last_of_multi = [], [], []
    for i in range(len(ids) - 1):
        if not s_tok.decode([ids[i + 1]]).strip().isdigit():
            continue
        c = ch[i + 1]
        (starts if ch[i] != c else inner).append(i)
        n_s = ch.count(c)
        n_t = row["teacher0_chunk"].count(c)
        if (n_s > 1 or n_t > 1) and (i + 2 >= len(ch) or ch[i + 2] != c):
            last_of_multi.append(i)
    return starts, inner, last_of_multi


def _in_multi(case, positions):
    """Those positions whose predicted token lies in a multi-token (3:1) chunk."""
    row = case[2]
    ch_s, ch_t = row["teacher0_student_chunk"], row["teacher0_chunk"]
    return [i for i in positions if ch_s.count(ch_s[i + 1]) > 1 or ch_t.count(ch_s[i + 1]) > 1]


def _word_positions(case):
    """Positions predicting a 1:1 word token (letters, not the multi-token " pears")."""
    s_tok, _, row, _, _ = case
    ids, ch_s, ch_t = row["student_ids"], row["teacher0_student_chunk"], row["teacher0_chunk"]
    out = []
    for i in range(len(ids) - 1):
        c = ch_s[i + 1]
        if c >= 0 and s_tok.decode([ids[i + 1]]).strip().isalpha() and ch_t.count(c) == 1:
            out.append(i)
    return out


def _xtoken(first_only):
    def run(student, teacher, batch, proj, s_tok, t_tok):
        cfg = XTokenConfig(k=8)
        spec = xtoken_teacher_spec(cfg, teacher_vocab_size=t_tok.vocab_size)
        te = teacher_outputs_from_logits(teacher, spec=spec)
        tables = XTokenTables.from_projection(
            proj, student_vocab_size=s_tok.vocab_size, first_only=first_only
        )
        return xtoken(
            student, te, index_chunks(batch), tables=tables, vocab_size=s_tok.vocab_size, config=cfg
        )

    return run


def _gold(rest_bucket):
    def run(student, teacher, batch, proj, s_tok, t_tok):
        cfg = GoldConfig(rest_bucket=rest_bucket)
        tables = GoldTables.from_projection(
            proj, teacher_vocab_size=t_tok.vocab_size, student_vocab_size=s_tok.vocab_size
        )
        spec = gold_teacher_spec(cfg, tables, teacher_vocab_size=t_tok.vocab_size)
        tgt = shift_targets(batch.teacher_ids, batch.teacher_len)
        te = teacher_outputs_from_logits(
            teacher, spec=spec, target_ids_BT=tgt, columns=tables.t_ids
        )
        return gold(
            student, te, index_chunks(batch), tables=tables, vocab_size=s_tok.vocab_size, config=cfg
        )

    return run


def _alm(student, teacher, batch, proj, s_tok, t_tok):
    tgt = shift_targets(batch.teacher_ids, batch.teacher_len)
    spec = alm_teacher_spec(AlmConfig(), teacher_vocab_size=t_tok.vocab_size)
    te = teacher_outputs_from_logits(teacher, spec=spec, target_ids_BT=tgt)
    return alm(student, te, index_chunks(batch), vocab_size=s_tok.vocab_size, config=AlmConfig())


def _ce(student, teacher, batch, proj, s_tok, t_tok):
    return ce(
        student, shift_targets(batch.student_ids, batch.student_len), vocab_size=s_tok.vocab_size
    )


def test_the_two_tokenizers_chunk_numbers_3_to_1(case):
    s_tok, t_tok, row, _, _ = case
    kinds = {}
    for c in range(row["teacher0_n_chunks"]):
        s_ids = [i for i, x in zip(row["student_ids"], row["teacher0_student_chunk"]) if x == c]
        t_ids = [i for i, x in zip(row["teacher0_ids"], row["teacher0_chunk"]) if x == c]
        kinds[s_tok.decode(s_ids)] = (len(s_ids), len(t_ids))
    assert kinds["202"] == (3, 1) and kinds["4"] == (1, 1)
    assert kinds["123"] == kinds["456"] == kinds["365"] == (3, 1)
    assert kinds[" we"] == (1, 1)


def test_ce_and_alm_raise_every_digit(case):
    starts, inner, last_of_multi = _digit_positions(case)
    multi = _in_multi(case, starts + inner)
    g, _ = _grads(case, _ce)
    assert all(g[i] < -0.05 for i in starts + inner)
    g, _ = _grads(case, _alm)
    # P_t("202") = 0.9 > P_s("2","0","2") = 0.729: every digit of the chunk goes up
    assert len(multi) == 12 and all(g[i] < -0.03 for i in multi)
    assert all(abs(g[i]) < 1e-3 for i in set(starts + inner) - set(multi))  # 1:1 digits agree


def test_xtoken_one_term_per_chunk_start_inner_digits_dropped(case):
    starts, inner, _ = _digit_positions(case)
    g, out = _grads(case, _xtoken(first_only=True))
    assert int(out.count) == case[2]["teacher0_n_chunks"]  # every chunk has its start term
    assert len(inner) == 8  # 2 + 4 + 2 inner digits of 2024, 1234567, 365
    assert all(g[i] == 0.0 for i in inner)  # no teacher distribution over that prefix
    # with bucketed first-token rows the oracles agree everywhere: at number chunk starts
    # ("202" -> bucket "2") and at " pears" (teacher " p" + "ears": bucket " p" holds " pears")
    assert all(abs(x) < 1e-2 for x in g)
    assert float(out.sum.detach()) < 1e-2


def test_xtoken_with_weighted_rows_lowers_the_right_first_digit(case):
    starts, _, _ = _digit_positions(case)
    g, _ = _grads(case, _xtoken(first_only=False))
    multi_starts = _in_multi(case, starts)
    assert len(multi_starts) == 4 and all(g[i] > 0.2 for i in multi_starts)


def test_gold_lowers_or_ignores_the_digits_of_multi_digit_chunks(case):
    starts, inner, last_of_multi = _digit_positions(case)
    prefix = [i for i in _in_multi(case, starts + inner) if i not in last_of_multi]
    words = _word_positions(case)
    g, out = _grads(case, _gold(rest_bucket=True))
    assert len(last_of_multi) == 4 and len(prefix) == 8
    # the teacher's "202" has no student twin: its mass lands in the rest bucket, which the
    # student can only fill by moving mass OFF "2","0": the right digits go down
    assert all(g[i] > 0.05 for i in prefix) and all(g[i] > 0 for i in last_of_multi)
    assert all(g[i] < 0 for i in words)  # while 1:1 words go up
    assert float(out.metrics["gold_unmatched_sum"]) > 1.0
    g, _ = _grads(case, _gold(rest_bucket=False))  # TRL's sub-simplex KL
    assert all(abs(g[i]) < 5e-3 for i in prefix + last_of_multi)  # digits get ~no signal
    assert all(g[i] < -0.02 for i in words)  # words do


def test_kd_topk_refuses_a_different_tokenizer(case):
    s_tok, t_tok, row, batch, _ = case
    teacher = _oracle(row["teacher0_ids"], t_tok.vocab_size)
    spec = kd_topk_teacher_spec(KDTopKConfig(k=4), teacher_vocab_size=t_tok.vocab_size)
    te = teacher_outputs_from_logits(teacher, spec=spec)
    student = _oracle(row["student_ids"], s_tok.vocab_size)
    mask = torch.ones(1, student.shape[1], dtype=torch.bool)
    with pytest.raises(ValueError, match="kd_topk"):  # other positions, other vocabulary
        kd_topk(student, te, mask, vocab_size=s_tok.vocab_size, config=KDTopKConfig(k=4))
