"""Context parallelism (CP) for the chunk modes (`xtoken`, `gold`, `alm`), and their common start.

Under CP a rank holds T / CP positions of every row while the `ChunkIndex` and the teacher
outputs stay whole, so a chunk may straddle a piece border: `owned_rows` says which rows a rank
holds (a chunk's term and count belong to one rank), `chunk_sum` finishes chain sums over the
group, `replicated` reports index-wide metrics once (docs/losses.md, "Parallelism").

Legend: G chunks or rows asked for, g of them held here, N flat positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tokenbridge.losses.ops.segments import ChunkIndex, segment_sum
from tokenbridge.teacher.outputs import TeacherOutputs

if TYPE_CHECKING:  # tokenbridge.dist_ops is imported lazily (see vocab_ops)
    from tokenbridge.dist_ops import CPContext


def cp_size(cp: CPContext | None) -> int:
    return 1 if cp is None else cp.size


def owned_rows(rows_G: Tensor, cp: CPContext | None) -> tuple[Tensor, Tensor]:
    """(local rows [g], mine [G] bool) of full-sequence flat rows ``rows_G`` (all >= 0).

    Sorted distinct rows stay sorted and distinct: the layout keeps the order of positions
    within a row (piece r before piece 2 * CP - 1 - r), and rows stay in batch order.
    """
    if cp_size(cp) == 1:
        return rows_G, torch.ones_like(rows_G, dtype=torch.bool)
    local_G = cp.local_rows(rows_G)
    mine_G = local_G >= 0
    return local_G[mine_G], mine_G


def chunk_sum(values_N: Tensor, seg_N: Tensor, n: int, cp: CPContext | None) -> Tensor:
    """[n] per-segment sums over the whole sequence (ids < 0 skipped); every CP rank gets them.
    Under CP a local `index_add`, then a differentiable all-reduce of the small [n] tensor whose
    backward all-reduces the gradient, so the owner's term reaches every rank's tokens."""
    if cp_size(cp) == 1:
        return segment_sum(values_N, seg_N, n)
    return cp.segment_sum(values_N, seg_N, n)


def replicated(metrics: dict[str, Tensor], cp: CPContext | None) -> dict[str, Tensor]:
    """Metrics every CP rank computes alike, kept on CP rank 0 only (zeros elsewhere)."""
    if cp_size(cp) == 1 or cp.rank == 0:
        return metrics
    return {k: torch.zeros_like(v) for k, v in metrics.items()}


def check_cp_shapes(mode: str, logits_BSV: Tensor, index: ChunkIndex, cp: CPContext | None) -> None:
    """The local logits must be this rank's share of the rows the index was built from."""
    b, s_local, _ = logits_BSV.shape
    width = index.student.width
    if cp_size(cp) > 1 and cp.seq_len != width:
        raise ValueError(
            f"{mode}: CPContext.seq_len is {cp.seq_len} but the ChunkIndex rows are {width} "
            "student positions wide (build the index from the whole rows, before the CP split)"
        )
    if b * s_local * cp_size(cp) != index.student.targets.numel():
        raise ValueError(
            f"{mode}: student logits {tuple(logits_BSV.shape)} (CP = {cp_size(cp)}) do not "
            f"match the ChunkIndex ({index.student.targets.numel()} student positions)"
        )


def complete_chunks(index: ChunkIndex) -> tuple[Tensor, dict[str, Tensor]]:
    """Chunks whose chains are complete on both sides (and selected: `ChunkIndex.select`,
    conversations' train masks), and the counts of those dropped."""
    st, te = index.student, index.teacher
    both = (st.count > 0) & (te.count > 0)
    ok = both & (st.start_rows() >= 0) & (te.start_rows() >= 0)
    dropped = {"chunks_empty_side": (~both).sum(), "chunks_unpredicted": (both & ~ok).sum()}
    if index.select is not None:
        dropped["chunks_unselected"] = (ok & ~index.select).sum()
        ok = ok & index.select
    return ok.nonzero().squeeze(1), dropped


def open_chunk_loss(
    mode: str,
    logits_BSV: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    cp: CPContext | None,
    *,
    fields: tuple[str, ...],
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """What every chunk loss starts with: the teacher ships ``fields`` (per teacher position,
    [B, T, ...]) for the rows the index was built from, and the logits fit the index
    (`check_cp_shapes`). Returns the logits flat [N, V], the complete chunks [G] and the
    dropped-chunk counts (reported once per CP group)."""
    teacher.require(fields, mode=mode)
    check_cp_shapes(mode, logits_BSV, index, cp)
    lead = getattr(teacher, fields[0])
    if lead.shape[0] * lead.shape[1] != index.teacher.targets.numel():
        raise ValueError(f"{mode}: teacher outputs do not match the ChunkIndex shapes")
    b, s, width = logits_BSV.shape
    chunks, metrics = complete_chunks(index)
    return logits_BSV.reshape(b * s, width), chunks, replicated(metrics, cp)
