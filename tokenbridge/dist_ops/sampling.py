"""Top-k / top-p (nucleus) truncation thresholds over a vocab-sharded logits chunk.

On-policy scoring reads sampled tokens under the distribution the sampler used (temperature,
top-k, top-p: vLLM's order) while no rank sees a whole row, so the truncation is one per-row
threshold, a constant for autograd; top-p's is found by bisection on the fp32 logits'
order-preserving int32 keys (docs/parallelism.md, "The distributed loss ops").

Legend: N rows, V local vocab columns; in: fp32 [N, V_local] already divided by the
temperature; out: [N] thresholds, identical on every TP rank (-inf = nothing truncated).
"""

from __future__ import annotations

import torch

from tokenbridge.dist_ops.collectives import all_gather_stack, all_reduce_
from tokenbridge.dist_ops.vocab_shard import VocabShard, global_max

_SIGN_OFF = 0x7FFFFFFF
_BISECT_ROUNDS = 33  # the int32 key range has 2**32 values


def float_key(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving map fp32 -> int64 (via the int32 bit pattern), for non-NaN inputs.

    -0.0 is folded into +0.0 first so that key order and float order agree exactly.
    """
    bits = (x.to(torch.float32) + 0.0).view(torch.int32)
    return (bits ^ ((bits >> 31) & _SIGN_OFF)).to(torch.int64)


def key_float(key: torch.Tensor) -> torch.Tensor:
    """Inverse of `float_key` (keys must lie in the int32 range)."""
    k = key.to(torch.int32)
    return (k ^ ((k >> 31) & _SIGN_OFF)).view(torch.float32)


def validate_sampling(top_k: int | None, top_p: float | None) -> None:
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def truncates(shard: VocabShard, top_k: int | None, top_p: float | None) -> bool:
    """Whether these sampling parameters can drop any column of this vocabulary."""
    return (top_k is not None and top_k < shard.v_global) or (top_p is not None and top_p < 1.0)


def topk_threshold(z_NV: torch.Tensor, shard: VocabShard, k: int) -> torch.Tensor:
    """The k-th largest value of each row over the whole (sharded) vocabulary: each rank's local
    top-min(k, V_local) all-gathered, then the k-th of those. Ties at it are all kept (as vLLM)."""
    kk = min(k, shard.v_local)
    cand_NK = z_NV.topk(kk, dim=-1).values
    cand_PNK = all_gather_stack(cand_NK, shard.group)
    cand_NC = cand_PNK.permute(1, 0, 2).reshape(z_NV.shape[0], -1)
    return cand_NC.topk(k, dim=-1).values[:, -1]


def topp_threshold(z_NV: torch.Tensor, shard: VocabShard, p: float) -> torch.Tensor:
    """Threshold of the nucleus of mass p; z may hold -inf.

    Column i is kept iff the mass (under the top-k-truncated distribution) of the columns with a
    strictly greater logit is < p: vLLM's rule (the most likely token always kept), except that
    tied logits are kept or dropped together, which makes it independent of the shard layout.
    Bisection finds the smallest key whose strict upper mass is < p.
    """
    group = shard.group
    m_N = global_max(z_NV, group)
    e_NV = torch.exp(z_NV - m_N[:, None])
    s_N = all_reduce_(e_NV.sum(dim=-1), group)
    prob_NV = e_NV / s_N[:, None]
    del e_NV
    key_NV = float_key(z_NV)
    # Invariant: upper_mass(lo) >= p > upper_mass(hi); hi starts at the row max's key.
    lo_N = torch.full_like(m_N, -(2**31) - 1, dtype=torch.int64)
    hi_N = all_reduce_(key_NV.amax(dim=-1), group, torch.distributed.ReduceOp.MAX)
    for _ in range(_BISECT_ROUNDS):  # fixed count keeps every TP rank in lockstep
        mid_N = torch.div(lo_N + hi_N, 2, rounding_mode="floor")
        upper_N = torch.where(key_NV > mid_N[:, None], prob_NV, 0.0).sum(dim=-1)
        all_reduce_(upper_N, group)
        below = upper_N < p
        hi_N = torch.where(below, mid_N, hi_N)
        lo_N = torch.where(below, lo_N, mid_N)
    return key_float(hi_N)


def sampling_threshold(
    z_NV: torch.Tensor, shard: VocabShard, *, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """Per-row keep threshold for temperature-scaled logits: top-k first, then top-p."""
    thr_N = torch.full((z_NV.shape[0],), float("-inf"), dtype=torch.float32, device=z_NV.device)
    if top_k is not None and top_k < shard.v_global:
        thr_N = topk_threshold(z_NV, shard, top_k)
    if top_p is not None and top_p < 1.0:
        z_kept = z_NV.masked_fill(z_NV < thr_N[:, None], float("-inf"))
        thr_N = torch.maximum(thr_N, topp_threshold(z_kept, shard, top_p))
    return thr_N
