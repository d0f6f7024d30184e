"""Dense, obviously-correct single-process references for the distributed ops.

Plain torch on the full [..., V] logits in float64 (so the reference error is negligible next to
the ops' fp32), written from the definitions, independent of the chunked Functions under test.
Used by the single-process unit tests and by every multi-process case.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def ref_truncate(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """vLLM order: top-k (ties at the k-th kept), then top-p over the renormalised remainder.

    A column is kept by top-p iff the mass of the columns sorted before it is < p.
    """
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, NEG_INF)
    if top_p is not None and top_p < 1.0:
        p = z.softmax(dim=-1)
        p_sorted, order = p.sort(dim=-1, descending=True)
        before = p_sorted.cumsum(dim=-1) - p_sorted
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before < top_p)
        z = z.masked_fill(~keep, NEG_INF)
    return z


def ref_target_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    z = ref_truncate(logits.double() / temperature, top_k, top_p)
    logp = torch.log_softmax(z, dim=-1)
    squeeze = ids.dim() == logits.dim() - 1
    idx = ids.unsqueeze(-1) if squeeze else ids
    out = logp.gather(-1, idx.clamp(0, logits.shape[-1] - 1))
    return out.squeeze(-1) if squeeze else out


def ref_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(dim=-1)  # 0 log 0 = 0


def ref_soft_ce(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(target.double() * torch.where(target > 0, logp, 0.0)).sum(dim=-1)


def ref_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.double().topk(k, dim=-1)


def value_and_grad(fn, x: torch.Tensor, weight: torch.Tensor | None = None, *, seed: int = 0):
    """(fn(x), d/dx sum(fn(x) * weight)) with a fixed random weight; -inf outputs are masked."""
    leaf = x.detach().clone().requires_grad_(True)
    out = fn(leaf)
    if weight is None:
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    finite = torch.isfinite(out)
    weight = weight.to(device=out.device, dtype=out.dtype)  # the CPU draw, on a GPU `out`
    loss = torch.where(finite, out * weight, torch.zeros_like(out)).sum()
    (grad,) = torch.autograd.grad(loss, leaf)
    return out.detach(), grad
