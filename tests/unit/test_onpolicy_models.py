"""On-policy losses through the real pieces (tiny random models with the REAL tokenizers): the
tiny SmolLM2 student samples, its rollouts are batched and aligned, each teacher scores them
with its channel program's forward, the registry's loss runs; value and gradient equal a dense
reference computed by hand from full-vocabulary log-softmaxes of both models on the same
rollouts. SmolLM2-vocab teacher (opd_topk, opd_pg) and Gemma-vocab teacher (opd_pg, alm); two
SmolLM2-vocab teachers mixed in probability space (`onpolicy.mix: mixture`)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenbridge import models
from tokenbridge.losses.alm import AlmConfig, binary_divergence
from tokenbridge.losses.modes import MODES
from tokenbridge.losses.opd import OPDPGConfig, OPDTopKConfig, mix_teacher_outputs
from tokenbridge.losses.ops.cp_chunks import complete_chunks
from tokenbridge.teacher.forward import teacher_forward
from tokenbridge.tokenizers import load_tokenizer
from trainer.config.schema import ModelConfig
from trainer.loss_terms import used_inputs
from trainer.onpolicy.agreement import completion_nats_bytes
from trainer.onpolicy.realign import TeacherView
from trainer.onpolicy.rollout_scoring import scoring_spec
from trainer.onpolicy.rollouts import build_batch, completion_rows
from trainer.onpolicy.sampling.sampler import SamplingConfig, sample

SMOL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
GEMMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
K = 8


@pytest.fixture(scope="module")
def setup(student_dir, teacher_dir):
    s_tok, g_tok = load_tokenizer(student_dir), load_tokenizer(teacher_dir)

    def build(path, seed, over):
        return models.build_model(ModelConfig(str(path), init="random", seed=seed, overrides=over))

    student = build(student_dir, 1, SMOL)
    same = models.freeze(build(student_dir, 2, SMOL))
    same2 = models.freeze(build(student_dir, 4, SMOL))
    gemma = models.freeze(build(teacher_dir, 3, GEMMA))
    texts = ["In the beginning God created", "And the earth was without form, and"]
    prompts = [[s_tok.bos_id, *s_tok.encode(t).ids.tolist()] for t in texts]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=12, n_samples=2, record_topk=K)
    r = sample(student.eval(), prompts, config=cfg, seeds=[1, 2, 3, 4], stop_ids=[s_tok.eos_id],
               vocab_size=s_tok.vocab_size)  # fmt: skip
    views = [None, TeacherView(g_tok, 512, stop_id=g_tok.eos_id)]
    batch = build_batch(r, list(range(len(r))), student=s_tok, teachers=views,
                        want_cols=[True, False], pad_id=0)  # fmt: skip
    return {"s_tok": s_tok, "student": student.train(), "same": same, "same2": same2,
            "gemma": gemma, "batch": batch}  # fmt: skip


def _used(record, prep, b, j):
    """Teacher j's inputs with the positions a run's worker computes (`used_inputs`)."""
    inputs = b.teacher_inputs[j]
    done = completion_rows(b.aligned[j], inputs["input_ids"].shape[1])
    return used_inputs(record, prep, inputs, completion=done)


def _outputs(model, inputs, spec):
    """The teacher's outputs as a run's worker computes them: at the ``used_mask`` positions
    only (`used_inputs`; NaN elsewhere, so a loss reading any other position fails here)."""
    return teacher_forward(
        model,
        inputs["input_ids"],
        inputs["attention_mask"],
        spec=spec,
        columns=inputs.get("col_ids"),
        chunk=7,  # several lm_head pieces
        used_BU=inputs["used_mask"],
    )


def _run(setup, mode, options, j, teacher, *, scale: float = 1.0):
    """(loss value, grad of the student logits) of `mode` vs teacher j of the batch; the
    student's logits times `scale` (random tiny models are nearly uniform: a sharper student
    makes the divergences large enough to compare closely; the top-k order is unchanged)."""
    b, s_tok = setup["batch"], setup["s_tok"]
    record = MODES[mode]
    t_vocab = teacher.config.vocab_size
    spec = scoring_spec(record.teacher_spec(options, None, teacher_vocab_size=t_vocab))
    prep = record.prepare(b.aligned[j], b.targets_BT)
    inputs = _used(record, prep, b, j)
    used, real = inputs["used_mask"], inputs["attention_mask"] > 0
    assert bool((used <= real).all()) and int(used.sum()) < int(real.sum())  # the prompt skipped
    outs = _outputs(teacher, inputs, spec)
    # the agreement eval reads the same outputs: equal to its value from every position's
    n, nbytes = completion_nats_bytes(b.aligned[j], outs, student_lengths=s_tok.token_lengths)
    full = teacher_forward(teacher, inputs["input_ids"], inputs["attention_mask"], spec=spec,
                           columns=inputs.get("col_ids"), chunk=7)  # fmt: skip
    want = completion_nats_bytes(b.aligned[j], full, student_lengths=s_tok.token_lengths)
    assert nbytes == want[1] > 0 and math.isclose(n, want[0], rel_tol=1e-6)
    with torch.no_grad():
        logits = setup["student"](input_ids=b.input_ids_BT, attention_mask=b.attention_mask_BT)
    x = (logits.logits.double() * scale).requires_grad_(True)
    out = record.loss(x, outs, prep, tables=None, vocab_size=s_tok.vocab_size, config=options)
    out.sum.backward()
    # chunk modes prepare a ChunkSplit: its text view holds the trained (completion) chunks
    return out, x.grad, logits.logits.double() * scale, getattr(prep, "text", prep)


def _teacher_logp(teacher, inputs):
    with torch.no_grad():
        z = teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    return torch.log_softmax(z.double(), -1)


def _chains(logq_BTV, logp_BUV, aligned, index, chunks):
    """Dense chunk chains (student with grad, teacher) by summing token log-probs by hand."""
    ls, lt = [], []
    s_ids, t_ids = aligned.student_ids, aligned.teacher_ids
    s_width, t_width = s_ids.shape[1], t_ids.shape[1]
    for c in chunks.tolist():
        b = int(index.chunk_row[c])
        s_pos = (aligned.student_chunk[b] == c - int(index.chunk_row.eq(b).nonzero()[0])).nonzero()
        t_pos = (aligned.teacher_chunk[b] == c - int(index.chunk_row.eq(b).nonzero()[0])).nonzero()
        assert s_pos.numel() and t_pos.numel() and s_width and t_width
        ls.append(sum(logq_BTV[b, i - 1, s_ids[b, i]] for i in s_pos[:, 0].tolist()))
        lt.append(sum(logp_BUV[b, i - 1, t_ids[b, i]] for i in t_pos[:, 0].tolist()))
    return torch.stack(ls), torch.stack(lt)


@pytest.mark.parametrize("teacher_name, j", [("same", 0), ("gemma", 1)])
def test_opd_pg_equals_dense_chains(setup, teacher_name, j):
    teacher = setup[teacher_name]
    out, grad, logits, index = _run(setup, "opd_pg", OPDPGConfig(), j, teacher)
    b = setup["batch"]
    chunks, _ = complete_chunks(index)
    assert chunks.numel() > 10 and int(out.count) == chunks.numel()
    y = logits.clone().requires_grad_(True)
    logq = torch.log_softmax(y, -1)
    logp = _teacher_logp(teacher, b.teacher_inputs[j])
    ls, lt = _chains(logq, logp, b.aligned[j], index, chunks)
    assert torch.allclose(out.sum, (ls - lt).sum().detach(), rtol=1e-5)
    (-((lt - ls).detach() * ls).sum()).backward()
    assert torch.allclose(grad, y.grad, rtol=1e-4, atol=1e-9)


def test_alm_on_gemma_rollouts_equals_dense_chains(setup):
    opts = AlmConfig()
    out, grad, logits, index = _run(setup, "alm", opts, 1, setup["gemma"])
    b = setup["batch"]
    chunks, _ = complete_chunks(index)
    y = logits.clone().requires_grad_(True)
    ls, lt = _chains(torch.log_softmax(y, -1), _teacher_logp(setup["gemma"], b.teacher_inputs[1]),
                     b.aligned[1], index, chunks)  # fmt: skip
    ref = binary_divergence(lt, ls, kind=opts.divergence, eps=opts.eps).sum()
    ref.backward()
    assert torch.allclose(out.sum, ref.detach(), rtol=1e-4)
    assert torch.allclose(grad, y.grad, rtol=1e-3, atol=1e-9)


def test_opd_topk_on_the_policy_support_equals_dense(setup):
    opts = OPDTopKConfig(k=K)
    out, grad, logits, mask = _run(setup, "opd_topk", opts, 0, setup["same"], scale=40.0)
    b = setup["batch"]
    cols = b.teacher_inputs[0]["col_ids"].long()
    y = logits.clone().requires_grad_(True)
    logq = torch.log_softmax(y[..., : setup["s_tok"].vocab_size], -1)
    logp = _teacher_logp(setup["same"], b.teacher_inputs[0])
    ref = torch.zeros((), dtype=torch.float64)
    rows = mask.nonzero().tolist()
    assert len(rows) == int(out.count) == int((b.targets_BT >= 0).sum())
    for bi, t in rows:
        s = cols[bi, t]
        assert (s >= 0).all()  # every position that predicts a sampled token has its support
        q, p = logq[bi, t, s].exp(), logp[bi, t, s].exp()
        Q = torch.cat([q, 1 - q.sum()[None]])
        P = torch.cat([p, 1 - p.sum()[None]])
        ref = ref + (Q * (Q.log() - P.log())).sum()  # reverse KL over k + 1 buckets
    ref.backward()
    assert float(ref.detach()) > 1.0
    assert torch.allclose(out.sum, ref.detach(), rtol=1e-4)
    assert torch.allclose(grad, y.grad, rtol=1e-3, atol=1e-8)


def test_mixture_of_two_teachers_equals_dense(setup):
    """opd_topk against w1 p1 + w2 p2 (both teachers score the student's top-k ids): reverse
    KL over the k + 1 buckets of the mixed distribution, value and gradient."""
    b, s_tok = setup["batch"], setup["s_tok"]
    record, opts, w = MODES["opd_topk"], OPDTopKConfig(k=K), [0.25, 0.75]
    spec = scoring_spec(record.teacher_spec(opts, None, teacher_vocab_size=s_tok.vocab_size))
    prep = record.prepare(b.aligned[0], b.targets_BT)
    inputs = _used(record, prep, b, 0)
    mixed = mix_teacher_outputs([_outputs(setup[n], inputs, spec) for n in ("same", "same2")], w)
    with torch.no_grad():
        z = setup["student"](input_ids=b.input_ids_BT, attention_mask=b.attention_mask_BT).logits
    logits = z.double() * 40.0
    x = logits.clone().requires_grad_(True)
    out = record.loss(x, mixed, prep, tables=None, vocab_size=s_tok.vocab_size, config=opts)
    out.sum.backward()
    y = logits.clone().requires_grad_(True)
    logq = torch.log_softmax(y[..., : s_tok.vocab_size], -1)
    p1, p2 = (_teacher_logp(setup[n], inputs).exp() for n in ("same", "same2"))
    cols = inputs["col_ids"].long()
    ref = torch.zeros((), dtype=torch.float64)
    for bi, t in prep.nonzero().tolist():
        c = cols[bi, t]
        q = logq[bi, t, c].exp()
        p = w[0] * p1[bi, t, c] + w[1] * p2[bi, t, c]
        Q, P = torch.cat([q, 1 - q.sum()[None]]), torch.cat([p, 1 - p.sum()[None]])
        ref = ref + (Q * (Q.log() - P.log())).sum()
    ref.backward()
    assert torch.allclose(out.sum, ref.detach(), rtol=1e-4)
    assert torch.allclose(x.grad, y.grad, rtol=1e-3, atol=1e-8)
