"""Dense, obviously-correct references for every loss mode, random aligned batches, and their tests.

The references hold full [V] distributions in float64 and loop over positions and chunks in
Python: slow, but each line is a formula of docs/losses.md. The fast modes are tested against
them in the test_loss_<mode>.py files (and bench/training/losses.py times them next to the fast
ones), with the checks those files share at the end of this one (value and gradient against the
reference, bf16, a batch without chunks).

Legend: B batch, S student / T teacher positions, Vs / Vt lm_head widths (> vocab sizes vs / vt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenbridge.losses import AlignedBatch, collate_aligned, index_chunks
from tokenbridge.losses.ops.segments import shift_targets

NEG = float("-inf")


# ---------------------------------------------------------------- random aligned batches


@dataclass
class Pair:
    batch: AlignedBatch
    rows: list[dict]  # the shard-like rows it was collated from
    vs: int  # student tokenizer vocab size (lm_head is wider)
    vt: int
    Vs: int  # student lm_head width
    Vt: int


def make_pair(
    seed: int,
    *,
    B: int = 3,
    vs: int = 40,
    vt: int = 60,
    pad_cols: tuple[int, int] = (5, 3),
    max_chunks: int = 6,
    bos: bool = True,
    empty_side_prob: float = 0.0,
) -> Pair:
    """Random rows with 1:1, 1:N, N:1 and N:M chunks, BOS (optional) and EOS as specials."""
    g = torch.Generator().manual_seed(seed)

    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    rows = []
    for _ in range(B):
        s_ids, s_ch, t_ids, t_ch = [], [], [], []
        if bos:
            s_ids.append(vs - 1)
            s_ch.append(-1)
            t_ids.append(vt - 1)
            t_ch.append(-1)
        n = rint(0 if B > 1 else 1, max_chunks)
        for c in range(n):
            ns, nt = rint(1, 3), rint(1, 3)
            if float(torch.rand(1, generator=g)) < empty_side_prob:
                if float(torch.rand(1, generator=g)) < 0.5:
                    ns = 0
                else:
                    nt = 0
            s_ids += [rint(0, vs - 3) for _ in range(ns)]
            s_ch += [c] * ns
            t_ids += [rint(0, vt - 3) for _ in range(nt)]
            t_ch += [c] * nt
        s_ids.append(vs - 2)
        s_ch.append(-1)
        t_ids.append(vt - 2)
        t_ch.append(-1)
        rows.append(
            {
                "student_ids": s_ids,
                "teacher0_ids": t_ids,
                "teacher0_student_chunk": s_ch,
                "teacher0_chunk": t_ch,
                "teacher0_n_chunks": n,
            }
        )
    batch = collate_aligned(rows, 0)
    return Pair(batch, rows, vs, vt, vs + pad_cols[0], vt + pad_cols[1])


def logits_for(pair: Pair, seed: int, *, dtype=torch.float32, scale: float = 3.0):
    """(student [B, S, Vs] leaf with grad, teacher [B, T, Vt]); padded columns get LARGE values
    so that forgetting the mask changes every result."""
    g = torch.Generator().manual_seed(seed)
    b = pair.batch
    s = torch.randn(b.student_ids.shape + (pair.Vs,), generator=g, dtype=torch.float64) * scale
    t = torch.randn(b.teacher_ids.shape + (pair.Vt,), generator=g, dtype=torch.float64) * scale
    s[..., pair.vs :] = 50.0
    t[..., pair.vt :] = 50.0
    return s.to(dtype).requires_grad_(), t.to(dtype)


def random_t2s(seed: int, *, Vt: int, vs: int, k: int = 3, empty_rows: int = 3):
    """Sparse teacher->student rows (ids, weights), some slots empty, some rows all empty."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vs, (Vt, k), generator=g)
    w = torch.rand(Vt, k, generator=g)
    ids[torch.rand(Vt, k, generator=g) < 0.25] = -1
    ids[:empty_rows] = -1
    w = w / w.sum(1, keepdim=True) * torch.rand(Vt, 1, generator=g).clamp(min=0.5)
    return ids, w


# ---------------------------------------------------------------- dense references


def masked_logp(logits_V: torch.Tensor, vocab: int, tau: float = 1.0) -> torch.Tensor:
    x = logits_V.double().clone()
    x[vocab:] = NEG
    return torch.log_softmax(x / tau, -1)


def dense_div(p: torch.Tensor, q: torch.Tensor, kind: str, beta: float = 0.5) -> torch.Tensor:
    """D(p || q) for probability vectors, 0 log 0 = 0."""

    def kl(a, b):
        return sum(a[i] * (torch.log(a[i]) - torch.log(b[i])) for i in range(len(a)) if a[i] > 0)

    if kind == "forward":
        return kl(p, q)
    if kind == "reverse":
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


def chunks_of(pair: Pair):
    """Per global chunk: (b, student positions, teacher positions), from the shard-like rows."""
    out = []
    for b, r in enumerate(pair.rows):
        for c in range(r["teacher0_n_chunks"]):
            sp = [i for i, x in enumerate(r["teacher0_student_chunk"]) if x == c]
            tp = [i for i, x in enumerate(r["teacher0_chunk"]) if x == c]
            out.append((b, sp, tp))
    return out


def ref_ce(student, pair: Pair):
    total = 0.0
    n = 0
    for b, r in enumerate(pair.rows):
        ids = r["student_ids"]
        for i in range(len(ids) - 1):
            total = total - masked_logp(student[b, i], pair.vs)[ids[i + 1]]
            n += 1
    return total, n


def ref_topk(logp_V: torch.Tensor, k: int) -> list[int]:
    order = torch.argsort(logp_V, descending=True).tolist()
    return [i for i in order[:k] if logp_V[i] > NEG]


def ref_kd_topk(student, teacher, mask, *, vs, k, kind="forward", beta=0.5, tau=1.0, support=None):
    """support: None = the teacher's top-k; else a [B, T, K] tensor of ids."""
    total = 0.0
    for b, i in mask.nonzero().tolist():
        lp = masked_logp(teacher[b, i], vs, tau)
        lq = masked_logp(student[b, i], vs, tau)
        ids = ref_topk(lp, k) if support is None else [j for j in support[b, i].tolist() if j >= 0]
        p = torch.stack([lp[j].exp() for j in ids] + [1 - sum(lp[j].exp() for j in ids)])
        q = torch.stack([lq[j].exp() for j in ids] + [1 - sum(lq[j].exp() for j in ids)])
        total = total + tau**2 * dense_div(p, q.clamp(min=0), kind, beta)
    return total


def dense_t2s(ids, w, Vs):
    W = torch.zeros(ids.shape[0], Vs, dtype=torch.float64)
    for r in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            if ids[r, j] >= 0 and w[r, j] > 0:
                W[r, ids[r, j]] += w[r, j].double()
    W = W / W.sum(1, keepdim=True).clamp(min=1.0)
    return W


def dense_t2s_first(ids, w, Vs):
    """The heaviest slot of each row, weight 1 (XTokenTables' default first_only rows)."""
    W = torch.zeros(ids.shape[0], Vs, dtype=torch.float64)
    for r in range(ids.shape[0]):
        best = max(
            ((float(w[r, j]), j) for j in range(ids.shape[1]) if ids[r, j] >= 0 and w[r, j] > 0),
            default=None,
            key=lambda x: x[0],
        )
        if best is not None:
            W[r, ids[r, best[1]]] = 1.0
    return W


def random_key(seed: int, vs: int, Vs: int, roots: int = 12) -> torch.Tensor:
    """An idempotent student bucket map: a few roots, every other valid id points at a root."""
    g = torch.Generator().manual_seed(seed)
    root_ids = torch.randperm(vs, generator=g)[:roots]
    key = torch.arange(Vs)
    members = torch.rand(vs, generator=g) < 0.5
    members[root_ids] = False
    key[:vs][members] = root_ids[torch.randint(0, roots, (int(members.sum()),), generator=g)]
    return key


def ref_xtoken(student, teacher, pair: Pair, W, *, k, kind="forward", beta=0.5, tau=1.0, key=None):
    """W: dense [Vt, Vs] teacher -> bucket weights; key: [Vs] student bucket map (None = id)."""
    total, n = 0.0, 0
    for b, sp, tp in chunks_of(pair):
        if not sp or not tp or sp[0] == 0 or tp[0] == 0:
            continue
        lp = masked_logp(teacher[b, tp[0] - 1], pair.vt, tau)
        ids = ref_topk(lp, k)
        P = sum(lp[j].exp() * W[j] for j in ids)
        support = [s for s in range(W.shape[1]) if any(W[j, s] > 0 for j in ids)]
        q = masked_logp(student[b, sp[0] - 1], pair.vs, tau).exp()
        if key is not None:  # pool every student token into its bucket
            q = torch.zeros_like(q).index_add(0, key, q)
        p = torch.stack([P[s] for s in support] + [1 - sum(P[s] for s in support)])
        qq = torch.stack([q[s] for s in support] + [1 - sum(q[s] for s in support)])
        total = total + tau**2 * dense_div(p, qq, kind, beta)
        n += 1
    return total, n


def chain(logits_TV, ids, positions, vocab):
    return sum(masked_logp(logits_TV[i - 1], vocab)[ids[i]] for i in positions)


def ref_bin(lt, ls, kind, tau=1.0, eps=1e-6):
    a = torch.exp(lt / tau - eps)
    bb = torch.exp(ls / tau - eps)
    if kind == "reverse_kl":
        a, bb = bb, a
    if kind == "ce":
        return -(a * torch.log(bb) + (1 - a) * torch.log(1 - bb))
    return a * torch.log(a / bb) + (1 - a) * torch.log((1 - a) / (1 - bb))


def ref_alm(student, teacher, pair: Pair, *, kind="kl", tau=1.0):
    total, n = 0.0, 0
    for b, sp, tp in chunks_of(pair):
        if not sp or not tp or sp[0] == 0 or tp[0] == 0:
            continue
        ls = chain(student[b], pair.rows[b]["student_ids"], sp, pair.vs)
        lt = chain(teacher[b], pair.rows[b]["teacher0_ids"], tp, pair.vt)
        total = total + ref_bin(lt, ls, kind, tau)
        n += 1
    return total, n


def ref_gold(
    student,
    teacher,
    pair: Pair,
    t_ids,
    s_ids,
    *,
    kind="forward",
    beta=0.5,
    tau=1.0,
    rest_bucket=True,
    weights=None,
):
    """TRL-style merge at the chunk's last token, exact-map KL (+ rest) and full sorted L1."""
    t_ids, s_ids = list(t_ids), list(s_ids)
    um_s = [v for v in range(pair.vs) if v not in set(s_ids)]
    um_t = [v for v in range(pair.vt) if v not in set(t_ids)]
    wm, wu = weights if weights is not None else (len(t_ids) / pair.vt, 1 - len(t_ids) / pair.vt)
    total, n = 0.0, 0
    for b, sp, tp in chunks_of(pair):
        if not sp or not tp or sp[0] == 0 or tp[0] == 0:
            continue
        ls_pre = (
            chain(student[b], pair.rows[b]["student_ids"], sp[:-1], pair.vs) if len(sp) > 1 else 0.0
        )
        lt_pre = (
            chain(teacher[b], pair.rows[b]["teacher0_ids"], tp[:-1], pair.vt)
            if len(tp) > 1
            else 0.0
        )
        us = (
            math.e**0
            * torch.exp(torch.as_tensor(ls_pre, dtype=torch.float64))
            * masked_logp(student[b, sp[-1] - 1], pair.vs, tau).exp()
        )
        ut = (
            torch.exp(torch.as_tensor(lt_pre, dtype=torch.float64))
            * masked_logp(teacher[b, tp[-1] - 1], pair.vt, tau).exp()
        )
        P = torch.stack([ut[t] for t in t_ids])
        Q = torch.stack([us[s] for s in s_ids])
        if rest_bucket:
            P = torch.cat([P, (1 - P.sum())[None]])
            Q = torch.cat([Q, (1 - Q.sum())[None]])
        matched = dense_div(P, Q, kind, beta)
        a = torch.sort(torch.stack([us[v] for v in um_s]), descending=True).values
        c = torch.sort(torch.stack([ut[v] for v in um_t]), descending=True).values
        width = max(len(a), len(c))
        a = torch.nn.functional.pad(a, (0, width - len(a)))
        c = torch.nn.functional.pad(c, (0, width - len(c)))
        total = total + wm * matched + wu * (a - c).abs().sum()
        n += 1
    return total, n


# ---------------------------------------------------------------- tests of the helpers


def test_make_pair_has_every_chunk_kind_and_valid_index():
    kinds = set()
    for seed in range(5):
        pair = make_pair(seed, B=4)
        idx = index_chunks(pair.batch)
        for _b, sp, tp in chunks_of(pair):
            kinds.add((min(len(sp), 2), min(len(tp), 2)))
        assert idx.n_chunks == int(pair.batch.n_chunks.sum())
    assert {(1, 1), (1, 2), (2, 1), (2, 2)} <= kinds


def test_dense_div_basic_properties():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    for kind in ("forward", "reverse", "jsd"):
        assert abs(float(dense_div(p, p, kind))) < 1e-12
    assert float(dense_div(p, q, "forward")) > 0
    assert float(dense_div(p, q, "jsd")) <= math.log(2) + 1e-12


def test_shift_targets_matches_rows():
    pair = make_pair(3, B=3)
    tg = shift_targets(pair.batch.student_ids, pair.batch.student_len)
    for b, r in enumerate(pair.rows):
        ids = r["student_ids"]
        assert tg[b, : len(ids) - 1].tolist() == ids[1:]
        assert (tg[b, len(ids) - 1 :] == -1).all()


# ---------------------------------------------------------------- microbatch invariance


def sub_pair(pair: Pair, b0: int, b1: int) -> Pair:
    rows = pair.rows[b0:b1]
    return Pair(collate_aligned(rows, 0), rows, pair.vs, pair.vt, pair.Vs, pair.Vt)


def split_invariance(pair: Pair, student, teacher, run, *, splits=(1, 2, 4)):
    """run(sub_pair, student_view, teacher_view) -> LossOutput. Checks that sum / global count
    and the gradients agree for every split of the batch into microbatches."""
    B = len(pair.rows)
    results = []
    for n in splits:
        student.grad = None
        edges = [round(i * B / n) for i in range(n + 1)]
        outs = []
        for b0, b1 in zip(edges[:-1], edges[1:]):
            sp = sub_pair(pair, b0, b1)
            S = sp.batch.student_ids.shape[1]
            T = sp.batch.teacher_ids.shape[1]
            outs.append(run(sp, student[b0:b1, :S], teacher[b0:b1, :T]))
        count = sum(int(o.count) for o in outs)
        total = 0.0
        for o in outs:
            part = o.sum / max(count, 1)
            if part.requires_grad:
                part.backward()
            total += float(part.detach())
        results.append((total, count, student.grad.clone() if student.grad is not None else None))
    t0, c0, g0 = results[0]
    for t, c, g in results[1:]:
        assert c == c0
        assert abs(t - t0) <= 1e-5 * max(1.0, abs(t0))
        torch.testing.assert_close(g, g0, rtol=1e-5, atol=1e-6)
    return results[0]


# ---------------------------------------------------------------- checks the mode tests share


def assert_same_grad(loss, ref, student) -> None:
    """The gradients of the fast loss and of its dense reference w.r.t. the student agree."""
    (g,) = torch.autograd.grad(loss, student)
    (gr,) = torch.autograd.grad(ref, student)
    torch.testing.assert_close(g, gr.float(), rtol=1e-5, atol=1e-5)


def assert_matches_ref(out, ref, n: int, student) -> None:
    """A loss output equals its dense reference: count (> 0), sum and gradient."""
    assert int(out.count) == n > 0
    torch.testing.assert_close(out.sum.double(), ref, rtol=1e-5, atol=1e-5)
    assert_same_grad(out.sum, ref, student)


def assert_bf16_close(run, student, teacher, ref) -> None:
    """run(student, teacher) -> LossOutput on bf16 logits lands within 5% of the reference,
    with a finite gradient."""
    half = student.detach().bfloat16().requires_grad_()
    out16 = run(half, teacher.bfloat16())
    out16.sum.backward()
    r = float(ref.detach())
    assert abs(float(out16.sum.detach()) - r) < 0.05 * r and torch.isfinite(half.grad.float()).all()


def chunkless_batch(pair: Pair) -> AlignedBatch:
    """The pair's rows with every chunk taken away (both sides), collated."""
    rows = [
        dict(
            r,
            teacher0_n_chunks=0,
            teacher0_student_chunk=[-1] * len(r["student_ids"]),
            teacher0_chunk=[-1] * len(r["teacher0_ids"]),
        )
        for r in pair.rows
    ]
    return collate_aligned(rows, 0)


def assert_empty_loss(out, student) -> None:
    """A loss over no chunk: zero sum, zero count, a usable all-zero gradient."""
    assert float(out.sum.detach()) == 0.0 and int(out.count) == 0
    out.sum.backward()
    assert (student.grad == 0).all()
