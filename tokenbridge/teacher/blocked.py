"""A teacher's top-k outputs in blocked passes over its vocabulary (one device, no TP).

Every output of a position is a reduction over all lm_head columns (262,144 for Gemma), and
whole-row torch ops read the fp32 logits seven times, out of every cache. Measured on one core
of a 2-core Intel Xeon for 240 positions, those passes took ~270 ms, a fifth of the bare
forward of the row (1.25 s). Here every pass reads them once, by blocks of columns, exactly
(docs/losses.md, "Blocked passes over the vocabulary").

Legend: R rows, V vocabulary columns, B blocks of a row, K top-k, C candidate columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256  # columns per block at most: the pass of maxes is [R, V / 256], the candidates k x 256
ROW_BYTES = 1 << 20  # the exp pass's rows at a time: ~1 MB, within a core's L2 cache


def pass_rows(rows: int, width: int, device) -> int:
    """Rows of the exp pass at a time: ~`ROW_BYTES` of them on the CPU (they stay in the core's
    cache), all of them on a GPU (one kernel each, not one per row)."""
    if torch.device(device).type != "cpu":
        return rows
    return max(1, min(rows, ROW_BYTES // (4 * width)))


def block_size(width: int, k: int) -> int:
    """Columns per block for a row of ``width`` and top ``k``; 0 where blocks would not pay
    (fewer than 4k blocks, or blocks of fewer than 64 columns)."""
    block = min(width & -width, BLOCK)  # the largest power of two dividing width, capped
    return block if block >= 64 and width // block >= 4 * k else 0


def topk_blocked(x_RV: Tensor, k: int, *, maxes_RB: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``torch.topk(x, k, dim=-1)`` (values, ids; largest first) from the k blocks of columns
    with the largest maxes (``maxes_RB``: those maxes when already computed). Exact: a column
    outside them that beat one inside would lie in a block whose max beats the max of every
    chosen block, so the chosen blocks hold k columns at least as large; among equal values the
    ids may differ from torch's. Falls back to torch.topk where `block_size` says 0."""
    R, V = x_RV.shape
    block = block_size(V, k)
    if not block or not x_RV.is_contiguous():
        return torch.topk(x_RV, k, dim=-1)
    if maxes_RB is None:
        maxes_RB = x_RV.view(R, V // block, block).amax(-1)
    vals, ids, _, _, _ = _top_from_blocks(x_RV, maxes_RB, k, block)
    return vals, ids


def _top_from_blocks(x_RV, maxes_RB, k, block):
    """(values [R, K], ids [R, K], the chosen blocks [R, K], the top k's places among the
    candidates [R, K], the candidates [R, C]): the chosen blocks' columns side by side."""
    R = x_RV.shape[0]
    chosen_RK = torch.topk(maxes_RB, k, dim=-1).indices
    offsets = torch.arange(block, device=x_RV.device)
    cols_RC = (chosen_RK[..., None] * block + offsets).view(R, k * block)
    cand_RC = x_RV.gather(1, cols_RC)
    vals, at_RK = torch.topk(cand_RC, k, dim=-1)
    return vals, cols_RC.gather(1, at_RK), chosen_RK, at_RK, cand_RC


def topk_fields(xs_RV: Tensor, k: int, work: Tensor) -> dict[str, Tensor] | None:
    """(max [R, 1], logZ [R], top-k values [R, K] and ids [R, K], tail log-mass [R]) of rows
    ``xs`` in the blocked passes (docs/losses.md, "Blocked passes over the vocabulary"), or None
    where `block_size` says the blocks would not pay. ``work``: a flat fp32 buffer of `pass_rows` rows at least.
    The tail log-mass is log sum exp over the columns outside the top k (not minus logZ)."""
    R, V = xs_RV.shape
    block = block_size(V, k)
    if not block or not xs_RV.is_contiguous() or xs_RV.dtype != torch.float32:
        return None
    B = V // block
    maxes_RB = xs_RV.view(R, B, block).amax(-1)
    m_R1 = maxes_RB.amax(-1, keepdim=True)
    m_R1 = torch.where(torch.isfinite(m_R1), m_R1, 0.0)  # an all -inf row: sums of zeros
    sums_RB = xs_RV.new_empty(R, B)
    n = pass_rows(R, V, xs_RV.device)
    if work.numel() < n * V:
        raise ValueError(f"topk_fields: work holds {work.numel()} values, needs {n} x {V}")
    for r0 in range(0, R, n):
        r1 = min(R, r0 + n)
        e = work[: (r1 - r0) * V].view(r1 - r0, V)
        torch.sub(xs_RV[r0:r1], m_R1[r0:r1], out=e).exp_()
        torch.sum(e.view(r1 - r0, B, block), -1, out=sums_RB[r0:r1])
    logz_R = m_R1[:, 0] + sums_RB.sum(-1).log()
    vals, ids, chosen_RK, at_RK, cand_RC = _top_from_blocks(xs_RV, maxes_RB, k, block)
    # the tail: every block not chosen, plus the chosen blocks' columns outside the top k
    inside = cand_RC.sub_(m_R1).exp_().scatter_(1, at_RK, 0.0).sum(-1)
    outside = sums_RB.scatter_(1, chosen_RK, 0.0).sum(-1)
    tail_R = m_R1[:, 0] + (inside + outside).log()
    return {"max": m_R1, "logz": logz_R, "vals": vals, "ids": ids, "tail": tail_R}
