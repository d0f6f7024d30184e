"""Entropy and soft-target cross entropy over a vocab-sharded vocabulary.

Same layout, chunking and conventions as `vocab_parallel`. Soft CE is not KL: KL(t || p) =
soft_ce - H(t), so log the true KL with `vp_entropy` of the teacher where that is what is read.
z = logits / temperature, p = softmax(z) over the whole vocabulary, lse = logsumexp(z).

Legend: N rows, V local vocab columns.
"""

from __future__ import annotations

import torch

from tokenbridge.dist_ops.collectives import Group
from tokenbridge.dist_ops.vocab_shard import (
    as_rows,
    backward_chunks,
    check_temperature,
    chunk_spans,
    finite_,
    global_max,
    global_sums,
    row_dot,
    rowwise,
    upcast,
    vocab_shard,
    workspace,
)


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, group, chunk_size, temperature):
        n, v = logits_NV.shape
        vocab_shard(group, v)
        lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        ent_N = torch.empty_like(lse_N)
        spans = chunk_spans(n, v, chunk_size)
        buf, buf_e = workspace(spans, v, logits_NV.device, count=2)
        for s, e in spans:
            w_NV = upcast(logits_NV[s:e], temperature, buf)
            m_N = global_max(w_NV, group)
            w_NV = finite_(w_NV.sub_(m_N[:, None]))  # z - m; masked columns stay finite
            e_NV = torch.exp(w_NV, out=buf_e[: e - s])
            # H = log(sum e) - sum e (z - m) / sum e, both sums in one collective
            s_N, ew_N = global_sums(group, e_NV.sum(dim=-1), row_dot(e_NV, w_NV))
            lse_N[s:e] = m_N + torch.log(s_N)
            ent_N[s:e] = torch.log(s_N) - ew_N / s_N
        ctx.save_for_backward(logits_NV, lse_N, ent_N)
        ctx.cfg = (chunk_size, temperature)
        return ent_N

    @staticmethod
    def backward(ctx, g_N):
        logits_NV, lse_N, ent_N = ctx.saved_tensors
        chunk_size, temperature = ctx.cfg
        grad_NV, spans, (buf, buf_p) = backward_chunks(logits_NV, chunk_size, count=2)
        for s, e in spans:
            logp_NV = finite_(upcast(logits_NV[s:e], temperature, buf).sub_(lse_N[s:e, None]))
            p_NV = torch.exp(logp_NV, out=buf_p[: e - s])
            # dz = -g p (log p + H) / temperature
            d_NV = logp_NV.add_(ent_N[s:e, None]).mul_(p_NV)  # p (log p + H), 0 where p = 0
            grad_NV[s:e] = d_NV.mul_(-g_N[s:e, None] / temperature)
        return grad_NV, None, None, None


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, target_NV, group, chunk_size, temperature):
        n, v = logits_NV.shape
        vocab_shard(group, v)
        lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        mass_N = torch.empty_like(lse_N)
        ce_N = torch.empty_like(lse_N)
        spans = chunk_spans(n, v, chunk_size)
        buf, buf_t = workspace(spans, v, logits_NV.device, count=2)
        for s, e in spans:
            z_NV = finite_(upcast(logits_NV[s:e], temperature, buf))  # t = 0 on masked columns
            t_NV = buf_t[: e - s].copy_(target_NV[s:e])
            m_N = global_max(z_NV, group)
            tz_N = row_dot(t_NV, z_NV)
            s_N, tz_N, ts_N = global_sums(
                group, z_NV.sub_(m_N[:, None]).exp_().sum(dim=-1), tz_N, t_NV.sum(dim=-1)
            )
            lse_N[s:e] = m_N + torch.log(s_N)
            mass_N[s:e] = ts_N
            ce_N[s:e] = ts_N * lse_N[s:e] - tz_N  # CE = (sum t) lse - sum t z
        ctx.save_for_backward(logits_NV, target_NV, lse_N, mass_N)
        ctx.cfg = (chunk_size, temperature)
        return ce_N

    @staticmethod
    def backward(ctx, g_N):
        logits_NV, target_NV, lse_N, mass_N = ctx.saved_tensors
        chunk_size, temperature = ctx.cfg
        grad_NV, spans, (buf,) = backward_chunks(logits_NV, chunk_size)
        for s, e in spans:
            p_NV = upcast(logits_NV[s:e], temperature, buf).sub_(lse_N[s:e, None]).exp_()
            # dz = g ((sum t) p - t) / temperature; the target gets no gradient
            d_NV = p_NV.mul_(mass_N[s:e, None]).sub_(target_NV[s:e])
            grad_NV[s:e] = d_NV.mul_(g_N[s:e, None] / temperature)
        return grad_NV, None, None, None, None


def vp_entropy(
    logits: torch.Tensor, group: Group, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) over the sharded vocabulary -> [...]."""
    return rowwise(_Entropy, logits, group, temperature=temperature, chunk_size=chunk_size)


def vp_soft_ce(
    logits: torch.Tensor,
    target_probs: torch.Tensor,
    group: Group,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """-sum_v t_v log softmax(logits / temperature)_v with t sharded like the logits -> [...].

    t need not sum to 1 exactly (a sub-distribution's mass is used). -inf logits are clamped to
    the most negative float, so target mass on a masked column gives a huge finite CE, not inf.
    """
    check_temperature(temperature)
    if target_probs.shape != logits.shape:
        raise ValueError(
            f"target_probs must match the logits shard {tuple(logits.shape)}, "
            f"got {tuple(target_probs.shape)}"
        )
    out_N = _SoftCE.apply(
        as_rows(logits), as_rows(target_probs.detach()), group, chunk_size, temperature
    )
    return out_N.reshape(logits.shape[:-1])
