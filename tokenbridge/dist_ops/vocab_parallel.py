"""Vocab-parallel log-softmax family over logits sharded on the last dim across a TP group.

Logits [..., V_local] are this rank's contiguous slice of equal shards, ids are global (ids no
shard owns read 0); per-row outputs are fp32 and identical on every TP rank, per-column outputs
stay sharded. The objective is replicated over TP, so a backward writes only the local shard's
gradient. Each Function walks the rows in chunks (`chunk_size`, None = ~8M elements a chunk)
and recomputes a chunk's softmax in backward (docs/parallelism.md, "The distributed loss ops").

Legend: N rows (flattened leading dims), V local vocab columns, K ids per row.
"""

from __future__ import annotations

import torch

from tokenbridge.dist_ops.collectives import Group, all_gather_stack, all_reduce_
from tokenbridge.dist_ops.sampling import sampling_threshold, truncates, validate_sampling
from tokenbridge.dist_ops.vocab_shard import (
    as_rows,
    backward_chunks,
    check_temperature,
    chunk_spans,
    global_max,
    global_sums,
    ids_as_rows,
    rowwise,
    upcast,
    vocab_shard,
    workspace,
)


def _lse_chunk_(z_NV: torch.Tensor, group: Group) -> torch.Tensor:
    """lse of a PRIVATE fp32 chunk; overwrites it with exp(z - max)."""
    m_N = global_max(z_NV, group)
    (s_N,) = global_sums(group, z_NV.sub_(m_N[:, None]).exp_().sum(dim=-1))
    return m_N + torch.log(s_N)


def _probs_(z_NV: torch.Tensor, lse_N: torch.Tensor) -> torch.Tensor:
    """softmax from a PRIVATE fp32 chunk and its lse, in place."""
    return z_NV.sub_(lse_N[:, None]).exp_()


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, group, chunk_size, temperature):
        n, v = logits_NV.shape
        vocab_shard(group, v)
        lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        spans = chunk_spans(n, v, chunk_size)
        (buf,) = workspace(spans, v, logits_NV.device)
        for s, e in spans:
            lse_N[s:e] = _lse_chunk_(upcast(logits_NV[s:e], temperature, buf), group)
        ctx.save_for_backward(logits_NV, lse_N)
        ctx.cfg = (chunk_size, temperature)
        return lse_N

    @staticmethod
    def backward(ctx, g_N):
        logits_NV, lse_N = ctx.saved_tensors
        chunk_size, temperature = ctx.cfg
        grad_NV, spans, (buf,) = backward_chunks(logits_NV, chunk_size)
        for s, e in spans:
            p_NV = _probs_(upcast(logits_NV[s:e], temperature, buf), lse_N[s:e])
            grad_NV[s:e] = p_NV.mul_(g_N[s:e, None] / temperature)  # dz = g p
        return grad_NV, None, None, None


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, group, chunk_size, temperature):
        n, v = logits_NV.shape
        vocab_shard(group, v)
        out_NV = torch.empty((n, v), dtype=torch.float32, device=logits_NV.device)
        lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        spans = chunk_spans(n, v, chunk_size)
        (buf,) = workspace(spans, v, logits_NV.device)
        for s, e in spans:
            z_NV = upcast(logits_NV[s:e], temperature, buf)
            m_N = global_max(z_NV, group)
            shifted = torch.sub(z_NV, m_N[:, None], out=out_NV[s:e])
            (s_N,) = global_sums(group, torch.exp(shifted, out=z_NV).sum(dim=-1))
            shifted.sub_(torch.log(s_N)[:, None])
            lse_N[s:e] = m_N + torch.log(s_N)
        ctx.save_for_backward(logits_NV, lse_N)
        ctx.cfg = (group, chunk_size, temperature)
        return out_NV

    @staticmethod
    def backward(ctx, g_NV):
        logits_NV, lse_N = ctx.saved_tensors
        group, chunk_size, temperature = ctx.cfg
        grad_NV, spans, (buf,) = backward_chunks(logits_NV, chunk_size)
        for s, e in spans:
            # dz = g - p sum_V g: that sum over the whole vocabulary is the one backward collective
            g = g_NV[s:e].to(torch.float32)
            (gsum_N,) = global_sums(group, g.sum(dim=-1))
            d_NV = _probs_(upcast(logits_NV[s:e], temperature, buf), lse_N[s:e])
            d_NV.mul_(-gsum_N[:, None]).add_(g)
            grad_NV[s:e] = d_NV.div_(temperature) if temperature != 1.0 else d_NV
        return grad_NV, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NV, ids_NK, group):
        shard = vocab_shard(group, x_NV.shape[-1])
        local_NK, inside_NK = shard.localize(ids_NK)
        vals_NK = x_NV.gather(1, local_NK)
        vals_NK = torch.where(inside_NK, vals_NK, torch.zeros_like(vals_NK))
        all_reduce_(vals_NK, group)
        ctx.save_for_backward(local_NK, inside_NK)
        ctx.x_meta = (x_NV.shape, x_NV.dtype, x_NV.device)
        return vals_NK

    @staticmethod
    def backward(ctx, g_NK):
        local_NK, inside_NK = ctx.saved_tensors
        shape, dtype, device = ctx.x_meta
        # into the owning shard only: the forward all-reduce's backward is the identity (the
        # objective is replicated over TP)
        grad_NV = torch.zeros(shape, dtype=dtype, device=device)
        g_NK = torch.where(inside_NK, g_NK, torch.zeros_like(g_NK)).to(dtype)
        return grad_NV.scatter_add_(1, local_NK, g_NK), None, None


class _TargetLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, ids_NK, group, chunk_size, temperature, top_k, top_p):
        n, v = logits_NV.shape
        shard = vocab_shard(group, v)
        local_NK, inside_NK = shard.localize(ids_NK)
        truncate = truncates(shard, top_k, top_p)
        out_NK = torch.empty(local_NK.shape, dtype=torch.float32, device=logits_NV.device)
        lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        thr_N = torch.full_like(lse_N, float("-inf"))
        spans = chunk_spans(n, v, chunk_size)
        (buf,) = workspace(spans, v, logits_NV.device)
        for s, e in spans:
            z_NV = upcast(logits_NV[s:e], temperature, buf)
            if truncate:
                thr_N[s:e] = sampling_threshold(z_NV, shard, top_k=top_k, top_p=top_p)
                z_NV.masked_fill_(z_NV < thr_N[s:e, None], float("-inf"))
            zt_NK = z_NV.gather(1, local_NK[s:e])
            zt_NK = torch.where(inside_NK[s:e], zt_NK, torch.zeros_like(zt_NK))
            m_N = global_max(z_NV, group)
            s_N, zt_NK = global_sums(group, z_NV.sub_(m_N[:, None]).exp_().sum(dim=-1), zt_NK)
            lse_N[s:e] = m_N + torch.log(s_N)
            out_NK[s:e] = zt_NK - lse_N[s:e, None]
        ctx.save_for_backward(logits_NV, local_NK, inside_NK, lse_N, thr_N)
        ctx.cfg = (chunk_size, temperature, truncate)
        return out_NK

    @staticmethod
    def backward(ctx, g_NK):
        logits_NV, local_NK, inside_NK, lse_N, thr_N = ctx.saved_tensors
        chunk_size, temperature, truncate = ctx.cfg
        grad_NV, spans, (buf,) = backward_chunks(logits_NV, chunk_size)
        for s, e in spans:
            z_NV = upcast(logits_NV[s:e], temperature, buf)
            # dz = (scatter_add(g) - p sum_k g_k) / temperature, p the truncated softmax; the
            # one-hot part goes only to ids this shard owns (and truncation kept)
            hit_NK = inside_NK[s:e]
            if truncate:
                dropped_NV = z_NV < thr_N[s:e, None]
                hit_NK = hit_NK & ~dropped_NV.gather(1, local_NK[s:e])
                z_NV.masked_fill_(dropped_NV, float("-inf"))
                del dropped_NV
            g = g_NK[s:e].to(torch.float32)
            d_NV = _probs_(z_NV, lse_N[s:e]).mul_(-g.sum(dim=-1, keepdim=True))
            d_NV.scatter_add_(1, local_NK[s:e], torch.where(hit_NK, g, 0.0))
            grad_NV[s:e] = d_NV.div_(temperature) if temperature != 1.0 else d_NV
        return grad_NV, None, None, None, None, None, None


def vp_logsumexp(
    logits: torch.Tensor, group: Group, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """log sum_v exp(logits_v / temperature) over the sharded vocabulary: [..., V_local] -> [...]."""
    return rowwise(_LogSumExp, logits, group, temperature=temperature, chunk_size=chunk_size)


def vp_log_softmax(
    logits: torch.Tensor, group: Group, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Log-softmax over the sharded vocabulary; fp32 [..., V_local], sharded like the input."""
    return rowwise(_LogSoftmax, logits, group, temperature=temperature, chunk_size=chunk_size)


def vp_softmax(
    logits: torch.Tensor, group: Group, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Softmax over the sharded vocabulary; fp32 [..., V_local], sharded like the input."""
    return vp_log_softmax(logits, group, temperature=temperature, chunk_size=chunk_size).exp()


def vp_gather(x: torch.Tensor, ids: torch.Tensor, group: Group) -> torch.Tensor:
    """Values of a vocab-sharded tensor x [..., V_local] at global ids [...] or [..., K]: the
    owning shard reads, the others give 0, then an all-reduce."""
    ids_NK, _ = ids_as_rows(ids, x.shape[:-1])
    return _Gather.apply(as_rows(x), ids_NK, group).reshape(ids.shape)


def vp_target_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    group: Group,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log softmax(logits / temperature) at global ids, optionally under top-k/top-p truncation.

    ids: [...] (one target per row, e.g. next tokens) or [..., K]; output has the ids' shape,
    fp32. Ids owned by no shard (e.g. -100) give -lse; mask them in the loss. Never
    materialises the log-softmax; truncated ids get -inf (`sampling`).
    """
    check_temperature(temperature)
    validate_sampling(top_k, top_p)
    ids_NK, _ = ids_as_rows(ids, logits.shape[:-1])
    out_NK = _TargetLogProbs.apply(
        as_rows(logits), ids_NK, group, chunk_size, temperature, top_k, top_p
    )
    return out_NK.reshape(ids.shape)


def vp_topk(logits: torch.Tensor, k: int, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k of vocab-sharded logits: (values [..., k] in input dtype, global ids int64).

    Values are differentiable (gradient to the owning shard). Rows are sorted descending; ties
    at the k-th value are broken arbitrarily.
    """
    x_NV = as_rows(logits)
    shard = vocab_shard(group, x_NV.shape[-1])
    if not 1 <= k <= shard.v_global:
        raise ValueError(f"k must be in [1, V={shard.v_global}], got {k}")
    with torch.no_grad():
        kk = min(k, shard.v_local)
        vals_NK, idx_NK = x_NV.topk(kk, dim=-1)
        cand_v = all_gather_stack(vals_NK, group).permute(1, 0, 2).reshape(x_NV.shape[0], -1)
        cand_i = all_gather_stack(idx_NK + shard.offset, group)
        cand_i = cand_i.permute(1, 0, 2).reshape(x_NV.shape[0], -1)
        top_idx = cand_v.topk(k, dim=-1).indices
        ids_NK = cand_i.gather(1, top_idx)
    values_NK = _Gather.apply(x_NV, ids_NK, group)
    lead = logits.shape[:-1]
    return values_NK.reshape(*lead, k), ids_NK.reshape(*lead, k)
