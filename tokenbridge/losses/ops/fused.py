"""Fused student-side reductions with analytic backwards (single device, ``tp_group=None``).

Composed from `vocab_ops`, "log q at a few ids + the exact rest" is ~10 passes over an fp32
[rows, V] block and a long autograd chain; these Functions loop over row blocks themselves and
write the gradient straight into ONE [N, V] buffer (or, for a `HeadLogits`, into the hidden
states' and the weight's), so nothing of size V outlives a block. Under TP the modes compose the
vocab-parallel ops instead (docs/losses.md, "Memory and speed").

Legend: N logits rows, V columns, G selected rows, K ids per row, M matched, U other columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenbridge.losses.base import compute_dtype
from tokenbridge.losses.ops.head_logits import HeadLogits, project, project_backward

NEG_INF = float("-inf")


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + chunk)) for a in range(0, n, chunk)]


def _contiguous(rows_r: Tensor) -> int | None:
    """First row if the rows are one contiguous range (read without a copy), else None."""
    lo = int(rows_r[0])
    return lo if int(rows_r[-1]) - lo + 1 == rows_r.numel() else None


def _put(grad_NV: Tensor, rows_r: Tensor, g_rV: Tensor) -> None:
    lo = _contiguous(rows_r)
    if lo is not None:
        grad_NV.narrow(0, lo, rows_r.numel()).copy_(g_rV)
    else:
        grad_NV[rows_r] = g_rV.to(grad_NV.dtype)


class _Source:
    """Where a Function reads logits rows: a [N, V] tensor, or a head's hidden states and weight
    (`HeadLogits`); and where its backward writes their gradient."""

    def __init__(self, logits_NV, hidden_NH, weight_VH, softcap):
        self.logits, self.hidden, self.weight = logits_NV, hidden_NH, weight_VH
        # a head with a row scale passes (softcap, scale [N]) through the softcap slot
        self.softcap, self.scale = softcap if isinstance(softcap, tuple) else (softcap, None)

    @property
    def anchor(self) -> Tensor:
        return self.logits if self.logits is not None else self.hidden

    def raw(self, rows_r: Tensor) -> Tensor:
        if self.logits is None:
            return project(self.hidden[rows_r], self.weight, softcap=self.softcap)
        lo = _contiguous(rows_r)
        return self.logits.narrow(0, lo, rows_r.numel()) if lo is not None else self.logits[rows_r]

    def grad_buffers(self) -> list[Tensor]:
        if self.logits is not None:
            return [torch.zeros_like(self.logits)]
        f32 = torch.float32 if self.hidden.dtype != torch.float64 else torch.float64
        return [torch.zeros_like(self.hidden, dtype=f32), torch.zeros_like(self.weight, dtype=f32)]

    def put(self, grads: list[Tensor], rows_r: Tensor, g_rV: Tensor, raw_rV: Tensor | None) -> None:
        """Add the gradient ``g_rV`` of rows ``rows_r`` (``raw_rV``: their raw logits, which
        soft-capping's derivative reads)."""
        if self.logits is not None:
            _put(grads[0], rows_r, g_rV)
            return
        if self.scale is not None:
            g_rV = g_rV * self.scale[rows_r].to(g_rV.dtype)[:, None]
        h = self.hidden[rows_r]
        gh, gw = project_backward(g_rV, h, self.weight, raw_rV, softcap=self.softcap)
        grads[0].index_add_(0, rows_r, gh.to(grads[0].dtype))
        grads[1].add_(gw)

    def grads(self, buffers: list[Tensor]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if self.logits is not None:
            return buffers[0], None, None
        return None, buffers[0].to(self.hidden.dtype), buffers[1].to(self.weight.dtype)


def _source(logits) -> tuple:
    """The Function inputs for a tensor or a `HeadLogits`: (logits, hidden, weight, softcap)."""
    if isinstance(logits, HeadLogits):
        hidden = logits.hidden.reshape(-1, logits.hidden.shape[-1])
        if logits.row_scale is not None:
            return None, hidden, logits.weight, (logits.softcap, logits.row_scale.reshape(-1))
        return None, hidden, logits.weight, logits.softcap
    return logits, None, None, None


def _x(src: _Source, raw_rV: Tensor, vocab_size: int, temperature: float) -> Tensor:
    """Raw logits rows as the reductions read them: compute dtype, padding masked, tempered."""
    x = raw_rV.to(compute_dtype(src.anchor))
    if vocab_size < x.shape[1]:
        x = x.masked_fill(torch.arange(x.shape[1], device=x.device) >= vocab_size, NEG_INF)
    return x / temperature if temperature != 1.0 else x


def _logz(x: Tensor) -> tuple[Tensor, Tensor]:
    """(row max made finite [r, 1], exp(x - max) [r, V])."""
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    return m, (x - m).exp_()


def _slot_fill(ids_rK: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(valid mask, write index per slot, has-any-valid per row): empty slots re-write the row's
    largest id (a valid id whenever the row has one), so their writes are harmless."""
    valid = ids_rK >= 0
    top = ids_rK.max(-1, keepdim=True).values.clamp(min=0)
    return valid, torch.where(valid, ids_rK, top), valid.any(-1)


class _LogProbsAtRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, hidden_NH, weight_VH, softcap, rows_G, ids_GK, vocab_size,
                temperature, chunk):  # fmt: skip
        src = _Source(logits_NV, hidden_NH, weight_VH, softcap)
        dtype, device = compute_dtype(src.anchor), src.anchor.device
        g, k = ids_GK.shape
        lp = torch.empty(g, k, dtype=dtype, device=device)
        rest, logz, top = (torch.empty(g, dtype=dtype, device=device) for _ in range(3))
        for a, b in _spans(g, chunk):
            x = _x(src, src.raw(rows_G[a:b]), vocab_size, temperature)
            m, e = _logz(x)
            s_all = e.sum(-1)
            valid, fill, has = _slot_fill(ids_GK[a:b])
            e.scatter_(1, fill, 0.0)
            s_rest = torch.where(has, e.sum(-1), s_all)
            del e
            logz[a:b] = m[:, 0] + s_all.log()
            lp[a:b] = torch.where(valid, x.gather(1, fill) - logz[a:b, None], NEG_INF)
            rest[a:b] = m[:, 0] + s_rest.log() - logz[a:b]
            top[a:b] = m[:, 0] - logz[a:b]
        ctx.save_for_backward(logits_NV, hidden_NH, weight_VH, rows_G, ids_GK, logz, rest)
        ctx.conf = (softcap, vocab_size, temperature, chunk)
        ctx.mark_non_differentiable(top)
        return lp, rest, top

    @staticmethod
    def backward(ctx, g_lp, g_rest, _g_top):
        # x the tempered row, S its ids, q = softmax(x), Q_rest = sum_{v not in S} q_v, g_k and
        # g_r the upstream gradients of log q_{S_k} and log Q_rest:
        #   d/dx_v = [v = S_k] g_k - q_v (sum_k g_k + g_r) + [v not in S] q_v g_r / Q_rest
        # rebuilt block by block from the raw logits into one buffer
        logits_NV, hidden_NH, weight_VH, rows_G, ids_GK, logz, rest = ctx.saved_tensors
        softcap, vocab_size, temperature, chunk = ctx.conf
        src = _Source(logits_NV, hidden_NH, weight_VH, softcap)
        grad = src.grad_buffers()
        for a, b in _spans(ids_GK.shape[0], chunk):
            raw = src.raw(rows_G[a:b])
            q = (_x(src, raw, vocab_size, temperature) - logz[a:b, None]).exp_()
            raw = raw if src.softcap is not None else None  # kept only for the cap's derivative
            valid, fill, has = _slot_fill(ids_GK[a:b])
            gl = torch.where(valid, g_lp[a:b], 0.0).to(q.dtype)
            gr = g_rest[a:b].to(q.dtype)
            total = gl.sum(-1) + gr
            q_rest = rest[a:b].exp()
            c = torch.where(q_rest > 0, gr / torch.where(q_rest > 0, q_rest, 1.0), 0.0)
            vals = gl - q.gather(1, fill) * total[:, None]
            # empty slots write the value of the slot that holds the same (largest) id
            vals = torch.where(valid, vals, vals.gather(1, ids_GK[a:b].argmax(-1, keepdim=True)))
            vals = torch.where(has[:, None], vals, 0.0)
            q.mul_((c - total)[:, None]).scatter_(1, fill, vals)
            if temperature != 1.0:
                q.div_(temperature)
            src.put(grad, rows_G[a:b], q, raw)
        return *src.grads(grad), None, None, None, None, None, None


def logprobs_at_rows(
    logits_NV: Tensor,
    rows_G: Tensor,
    ids_GK: Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log q at ids [G, K], log Q_rest [G], max_v log q_v [G] (no grad)) at rows ``rows_G`` of
    raw logits (columns >= vocab_size masked, divided by ``temperature`` here). Rows sorted and
    distinct; ids distinct within a row, ids < 0 empty slots (-inf, no gradient)."""
    if isinstance(logits_NV, HeadLogits):
        chunk_size = logits_NV.chunk
    return _LogProbsAtRows.apply(
        *_source(logits_NV), rows_G, ids_GK, vocab_size, temperature, chunk_size
    )


class _MatchedCrossRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, hidden_NH, weight_VH, softcap, rows_G, logp_fn, s_ids_M, other_U,
                vocab_size, temperature, chunk):  # fmt: skip
        src = _Source(logits_NV, hidden_NH, weight_VH, softcap)
        dtype, device = compute_dtype(src.anchor), src.anchor.device
        g = rows_G.numel()
        logz = torch.empty(g, dtype=dtype, device=device)
        cross = torch.empty_like(logz)
        x_other = torch.empty(g, other_U.numel(), dtype=dtype, device=device)
        ent, mass = torch.empty_like(logz), torch.empty_like(logz)
        for a, b in _spans(g, chunk):
            x = _x(src, src.raw(rows_G[a:b]), vocab_size, temperature)
            m, e = _logz(x)
            logz[a:b] = m[:, 0] + e.sum(-1).log()
            del e
            logp = logp_fn(a, b).to(dtype)
            p = logp.exp()
            mass[a:b] = p.sum(-1)
            # P = 0 terms are 0 in both sums (0 * -inf = nan -> 0); P > 0 at x = -inf stays -inf
            ent[a:b] = (p * logp).nan_to_num_(nan=0.0, neginf=NEG_INF).sum(-1)
            prod = p.mul_(x.index_select(1, s_ids_M))
            cross[a:b] = prod.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=NEG_INF).sum(-1)
            x_other[a:b] = x.index_select(1, other_U)
        ctx.save_for_backward(logits_NV, hidden_NH, weight_VH, rows_G, s_ids_M, other_U, logz)
        ctx.conf = (softcap, logp_fn, vocab_size, temperature, chunk)
        ctx.mark_non_differentiable(ent, mass)
        return logz, cross, x_other, ent, mass

    @staticmethod
    def backward(ctx, g_logz, g_cross, g_other, _g_ent, _g_mass):
        # logz, cross = sum_m P_m x_{s_m} and x at the other ids o_u:
        #   d/dx_v = g_logz q_v + g_cross sum_m P_m [v = s_m] + sum_u g_u [v = o_u]
        logits_NV, hidden_NH, weight_VH, rows_G, s_ids_M, other_U, logz = ctx.saved_tensors
        softcap, logp_fn, vocab_size, temperature, chunk = ctx.conf
        src = _Source(logits_NV, hidden_NH, weight_VH, softcap)
        grad = src.grad_buffers()
        for a, b in _spans(rows_G.numel(), chunk):
            raw = src.raw(rows_G[a:b])
            q = (_x(src, raw, vocab_size, temperature) - logz[a:b, None]).exp_()
            raw = raw if src.softcap is not None else None  # kept only for the cap's derivative
            q.mul_(g_logz[a:b].to(q.dtype)[:, None])
            p = logp_fn(a, b).to(q.dtype).exp_().mul_(g_cross[a:b].to(q.dtype)[:, None])
            q.index_add_(1, s_ids_M, p).index_add_(1, other_U, g_other[a:b].to(q.dtype))
            if temperature != 1.0:
                q.div_(temperature)
            src.put(grad, rows_G[a:b], q, raw)
        return *src.grads(grad), None, None, None, None, None, None, None, None


def matched_cross_rows(
    logits_NV: Tensor,
    rows_G: Tensor,
    logp_fn,
    *,
    s_ids: Tensor,
    other_ids: Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """At rows ``rows_G`` of raw logits, the student side of `gold`'s forward KL: (logz [G],
    sum_m P_m x_{s_m} [G], x at ``other_ids`` [G, U], and, without gradient, the teacher's
    sum_m P_m log P_m [G] and sum_m P_m [G]). ``logp_fn(a, b)`` gives log P [b - a, M] for the
    selected rows a..b (built per block, so [G, M] never exists at once); P = 0 terms are 0.
    Rows sorted and distinct."""
    if isinstance(logits_NV, HeadLogits):
        chunk_size = logits_NV.chunk
    return _MatchedCrossRows.apply(
        *_source(logits_NV), rows_G, logp_fn, s_ids, other_ids, vocab_size, temperature,
        chunk_size,
    )  # fmt: skip
