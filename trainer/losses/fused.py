"""Fused "log-probs at a few ids + the exact rest" with an analytic backward (single device).

`kd_topk` and `xtoken` need, per row, log q at K ids and log of the mass outside them. Composed
from `vocab_ops` that is ~10 passes over the fp32 [rows, V] block forward, as many again when
checkpointing recomputes it, and a long autograd chain. This Function reads the block twice in
forward (max, exp) and once in backward, and saves nothing of size V: it keeps the raw block (a
view of the logits, alive anyway), the row indices and per-row statistics, and rebuilds
q = softmax(x) in backward. With x the masked, temperature-scaled row, S the ids, q = softmax(x),
Q_rest = sum_{v not in S} q_v, upstream gradients g_k (for log q_{S_k}) and g_r (for log Q_rest):

    d/dx_v = [v = S_k] g_k - q_v (sum_k g_k + g_r) + [v not in S] q_v g_r / Q_rest

Used when ``tp_group`` is None; with a tensor-parallel group the modes compose the vocab-parallel
ops instead. Ids < 0 are empty slots (-inf, no gradient); ids must be distinct within a row.

Legend: c block rows, r selected rows, V columns, K ids per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.losses.base import compute_dtype

NEG_INF = float("-inf")


def _rows(block_cV: Tensor, local_r: Tensor, vocab_size: int, temperature: float) -> Tensor:
    x = block_cV if local_r.numel() == block_cV.shape[0] else block_cV[local_r]
    x = x.to(compute_dtype(block_cV))
    if vocab_size < x.shape[1]:
        x = x.masked_fill(torch.arange(x.shape[1], device=x.device) >= vocab_size, NEG_INF)
    return x / temperature if temperature != 1.0 else x


def _slot_fill(ids_rK: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(valid mask, write index per slot, has-any-valid per row): empty slots re-write the row's
    largest id (a valid id whenever the row has one), so their writes are harmless."""
    valid = ids_rK >= 0
    top = ids_rK.max(-1, keepdim=True).values.clamp(min=0)
    return valid, torch.where(valid, ids_rK, top), valid.any(-1)


class _LogProbsAtIds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block_cV, local_r, ids_rK, vocab_size, temperature):
        x = _rows(block_cV, local_r, vocab_size, temperature)
        m = x.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)
        e = (x - m).exp_()
        s_all = e.sum(-1)
        valid, fill, has = _slot_fill(ids_rK)
        e.scatter_(1, fill, 0.0)
        s_rest = torch.where(has, e.sum(-1), s_all)
        del e
        logz = m[:, 0] + s_all.log()
        lp = torch.where(valid, x.gather(1, fill) - logz[:, None], NEG_INF)
        log_rest = m[:, 0] + s_rest.log() - logz
        ctx.save_for_backward(block_cV, local_r, ids_rK, logz, log_rest)
        ctx.vocab_size, ctx.temperature = vocab_size, temperature
        top = m[:, 0] - logz  # log-prob of the argmax, for accuracy metrics
        ctx.mark_non_differentiable(top)
        return lp, log_rest, top

    @staticmethod
    def backward(ctx, g_lp, g_rest, _g_top):
        block_cV, local_r, ids_rK, logz, log_rest = ctx.saved_tensors
        x = _rows(block_cV, local_r, ctx.vocab_size, ctx.temperature)
        q = (x - logz[:, None]).exp_()
        del x
        valid, fill, has = _slot_fill(ids_rK)
        g_lp = torch.where(valid, g_lp, 0.0).to(q.dtype)
        g_rest = g_rest.to(q.dtype)
        total = g_lp.sum(-1) + g_rest
        q_rest = log_rest.exp()
        c = torch.where(q_rest > 0, g_rest / torch.where(q_rest > 0, q_rest, 1.0), 0.0)
        q_ids = q.gather(1, fill)
        vals = g_lp - q_ids * total[:, None]
        # empty slots write the value of the slot that holds the same (largest) id
        vals = torch.where(valid, vals, vals.gather(1, ids_rK.argmax(-1, keepdim=True)))
        vals = torch.where(has[:, None], vals, 0.0)
        grad = q.mul_((c - total)[:, None])
        grad.scatter_(1, fill, vals)
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        if local_r.numel() == block_cV.shape[0]:
            out = grad.to(block_cV.dtype)
        else:
            out = torch.zeros_like(block_cV)
            out[local_r] = grad.to(block_cV.dtype)
        return out, None, None, None, None


def logprobs_at_ids(
    block_cV: Tensor, local_r: Tensor, ids_rK: Tensor, *, vocab_size: int, temperature: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """(log q at ids [r, K], log Q_rest [r], max_v log q_v [r] (no grad)) for rows ``local_r``
    of a raw logits block.

    Masks columns >= vocab_size and divides by ``temperature`` itself (from the raw block, so
    nothing of size V is saved for backward).
    """
    c, r = block_cV.shape[0], local_r.numel()
    if r != c and 2 * r >= c:
        # most rows selected: run on the whole block (unselected rows get no ids and no
        # gradient) rather than copy the selected rows out, in forward and again in backward
        every = torch.arange(c, device=local_r.device)
        ids_cK = ids_rK.new_full((c, ids_rK.shape[1]), -1)
        ids_cK[local_r] = ids_rK
        lp, rest, top = _LogProbsAtIds.apply(block_cV, every, ids_cK, vocab_size, temperature)
        return lp[local_r], rest[local_r], top[local_r]
    return _LogProbsAtIds.apply(block_cV, local_r, ids_rK, vocab_size, temperature)


class _MatchedCross(torch.autograd.Function):
    """Per row: logz, cross = sum_m P_m x_{s_m} (P_m = 0 terms exactly 0), x at ``other`` ids."""

    @staticmethod
    def forward(ctx, block_cV, local_r, logp_rM, s_ids_M, other_U, vocab_size, temperature):
        x = _rows(block_cV, local_r, vocab_size, temperature)
        m = x.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)
        logz = m[:, 0] + (x - m).exp_().sum(-1).log()
        prod = logp_rM.to(x.dtype).exp() * x.index_select(1, s_ids_M)
        cross = prod.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=NEG_INF).sum(-1)
        x_other = x.index_select(1, other_U)
        ctx.save_for_backward(block_cV, local_r, logp_rM, s_ids_M, other_U, logz)
        ctx.vocab_size, ctx.temperature = vocab_size, temperature
        return logz, cross, x_other

    @staticmethod
    def backward(ctx, g_logz, g_cross, g_other):
        block_cV, local_r, logp_rM, s_ids_M, other_U, logz = ctx.saved_tensors
        x = _rows(block_cV, local_r, ctx.vocab_size, ctx.temperature)
        grad = (x - logz[:, None]).exp_()
        del x
        grad.mul_(g_logz.to(grad.dtype)[:, None])
        p = logp_rM.to(grad.dtype).exp()
        grad.index_add_(1, s_ids_M, p.mul_(g_cross.to(grad.dtype)[:, None]))
        grad.index_add_(1, other_U, g_other.to(grad.dtype))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        if local_r.numel() == block_cV.shape[0]:
            out = grad.to(block_cV.dtype)
        else:
            out = torch.zeros_like(block_cV)
            out[local_r] = grad.to(block_cV.dtype)
        return out, None, None, None, None, None, None


def matched_cross(
    block_cV: Tensor,
    local_r: Tensor,
    logp_rM: Tensor,
    s_ids_M: Tensor,
    other_U: Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(logz [r], sum_m exp(logp_m) x_{s_m} [r], x at ``other_U`` [r, U]) of the rows ``local_r``
    of a raw logits block (x masked and scaled): the student side of `gold`'s forward KL, with
    one gather over the M matched columns and no log-softmax."""
    return _MatchedCross.apply(
        block_cV, local_r, logp_rM, s_ids_M, other_U, vocab_size, temperature
    )
