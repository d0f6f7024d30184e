"""Context parallel (CP): the load-balanced sequence layout and the few collectives a loss needs.

A sequence of T tokens is cut into 2 * CP pieces and rank r holds pieces r and 2 * CP - 1 - r,
which balances causal attention's work. Per-token inputs are selected locally (`to_cp_layout`),
so the logits never leave their rank; only the shift across piece borders and per-segment sums
communicate (docs/parallelism.md, "The distributed loss ops").

Legend: T global sequence length, L = T / CP local tokens, S segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tokenbridge.dist_ops.collectives import (
    Group,
    all_gather_stack,
    all_reduce_,
    all_reduce_sum,
    group_rank,
    group_size,
)


def cp_piece_bounds(seq_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """[start, end) of the two pieces CP rank `cp_rank` holds, in layout order."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"bad CP rank {cp_rank} of {cp_size}")
    if cp_size == 1:
        return [(0, seq_len)]
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2 * CP = {2 * cp_size}; pad it"
        )
    piece = seq_len // (2 * cp_size)
    return [(j * piece, (j + 1) * piece) for j in (cp_rank, 2 * cp_size - 1 - cp_rank)]


def cp_positions(
    seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (int64 [L]) of this rank's tokens, in layout order."""
    spans = cp_piece_bounds(seq_len, cp_size, cp_rank)
    return torch.cat([torch.arange(s, e, device=device) for s, e in spans])


def to_cp_layout(x: torch.Tensor, *, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (differentiable index_select on `dim`)."""
    if cp_size == 1:
        return x
    pos_L = cp_positions(x.shape[dim], cp_size, cp_rank, device=x.device)
    return x.index_select(dim, pos_L)


def from_cp_layout(x_rank_major: torch.Tensor, *, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Rank-major concatenation of every rank's local tokens -> natural sequence order."""
    if cp_size == 1:
        return x_rank_major
    seq_len = x_rank_major.shape[dim]
    order_T = torch.cat([cp_positions(seq_len, cp_size, r) for r in range(cp_size)])
    inverse_T = torch.empty_like(order_T)
    inverse_T[order_T] = torch.arange(seq_len)
    return x_rank_major.index_select(dim, inverse_T.to(x_rank_major.device))


def cp_local_rows(
    flat_rows: torch.Tensor, *, seq_len: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Flat full-batch rows b * T + t -> flat local rows b * L + j on this CP rank, -1 elsewhere.

    For losses indexed by full-sequence positions (aligned chunks' start / last rows): keep the
    rows this rank holds (`>= 0`) and index the CP-local logits [B * L, V] with them.
    """
    pos_L = cp_positions(seq_len, cp_size, cp_rank, device=flat_rows.device)
    inverse_T = torch.full((seq_len,), -1, dtype=torch.int64, device=flat_rows.device)
    inverse_T[pos_L] = torch.arange(pos_L.numel(), device=flat_rows.device)
    rows = flat_rows.long()
    b, t = rows.div(seq_len, rounding_mode="floor"), rows.remainder(seq_len)
    j = inverse_T[t]
    return torch.where((rows >= 0) & (j >= 0), b * pos_L.numel() + j, -1)


def next_token_targets(ids: torch.Tensor, *, fill: int = -100, dim: int = 1) -> torch.Tensor:
    """targets[t] = ids[t + 1] along `dim` of the FULL sequence, `fill` at the last position.

    Shift first, then `to_cp_layout`: no communication needed for targets.
    """
    body = ids.narrow(dim, 1, ids.shape[dim] - 1)
    tail = torch.full_like(ids.narrow(dim, 0, 1), fill)
    return torch.cat([body, tail], dim=dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_L, group):
        ctx.group = group
        gathered = all_gather_stack(x_L, group)  # [CP, L, ...] rank-major
        return from_cp_layout(gathered.flatten(0, 1), cp_size=gathered.shape[0], dim=0)

    @staticmethod
    def backward(ctx, g_T):
        group = ctx.group
        size = group_size(group)
        pos_L = cp_positions(g_T.shape[0], size, group_rank(group), device=g_T.device)
        order = torch.cat([cp_positions(g_T.shape[0], size, r) for r in range(size)])
        rank_major = g_T.index_select(0, order.to(g_T.device)).contiguous()
        out_L = torch.empty((pos_L.numel(), *g_T.shape[1:]), dtype=g_T.dtype, device=g_T.device)
        dist.reduce_scatter_single(out_L, rank_major, group=group)
        return out_L, None


def cp_all_gather(x_local: torch.Tensor, group: Group, *, dim: int = 1) -> torch.Tensor:
    """All-gather a CP-sharded tensor into natural sequence order (backward: reduce-scatter)."""
    if group_size(group) == 1:
        return x_local
    out = _AllGather.apply(x_local.movedim(dim, 0).contiguous(), group)
    return out.movedim(0, dim)


class _ShiftNext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_L, group, fill):
        size, rank = group_size(group), group_rank(group)
        half = x_L.shape[0] // 2
        pieces = (rank, 2 * size - 1 - rank)
        # a piece's last output is the next piece's first element, which may sit on another
        # rank: one all-gather of every rank's two piece-first elements
        firsts = all_gather_stack(torch.stack([x_L[0], x_L[half]]), group)  # [CP, 2, ...]
        first_of = {r: firsts[r, 0] for r in range(size)}
        first_of.update({2 * size - 1 - r: firsts[r, 1] for r in range(size)})
        out = torch.empty_like(x_L)
        for slot, piece in enumerate(pieces):
            lo, hi = slot * half, (slot + 1) * half
            out[lo : hi - 1] = x_L[lo + 1 : hi]
            nxt = first_of.get(piece + 1)
            out[hi - 1] = nxt if nxt is not None else fill
        ctx.meta = (group, size, rank, half)
        return out

    @staticmethod
    def backward(ctx, g_L):
        group, size, rank, half = ctx.meta
        pieces = (rank, 2 * size - 1 - rank)
        # gradient of the element each piece borrowed from the next piece (its last output)
        borders = all_gather_stack(torch.stack([g_L[half - 1], g_L[2 * half - 1]]), group)
        border_of = {r: borders[r, 0] for r in range(size)}
        border_of.update({2 * size - 1 - r: borders[r, 1] for r in range(size)})
        grad = torch.zeros_like(g_L)
        for slot, piece in enumerate(pieces):
            lo, hi = slot * half, (slot + 1) * half
            grad[lo + 1 : hi] = g_L[lo : hi - 1]
            if piece > 0:
                grad[lo] = border_of[piece - 1]
        return grad, None, None


def cp_shift_next(
    x_local: torch.Tensor, group: Group, *, dim: int = 1, fill: float | int = 0
) -> torch.Tensor:
    """y[t] = x[t + 1] (global positions) for a CP-sharded tensor; y[T - 1] = `fill`."""
    if group_size(group) == 1:
        return next_token_targets(x_local, fill=fill, dim=dim)
    x_L = x_local.movedim(dim, 0).contiguous()
    if x_L.shape[0] % 2:
        raise ValueError(f"CP-local length must be even (two pieces), got {x_L.shape[0]}")
    return _ShiftNext.apply(x_L, group, fill).movedim(0, dim)


def cp_segment_sum(
    values: torch.Tensor, seg_ids: torch.Tensor, n_segments: int, group: Group
) -> torch.Tensor:
    """Sum `values` per segment id over the whole (CP-sharded) sequence -> [S], on every rank.

    seg_ids: same shape as values, ids in [0, S) or -1 for tokens outside any segment.
    Differentiable w.r.t. `values`; the backward all-reduces the gradient of the [S] sums.
    """
    if values.shape != seg_ids.shape:
        raise ValueError(f"values {tuple(values.shape)} vs seg_ids {tuple(seg_ids.shape)}")
    flat_ids = seg_ids.reshape(-1).long()
    keep = flat_ids >= 0
    sums_S = values.new_zeros(n_segments)
    sums_S = sums_S.index_add(0, flat_ids[keep], values.reshape(-1)[keep])
    return all_reduce_sum(sums_S, group)


def cp_segment_owner(seg_ids: torch.Tensor, n_segments: int, group: Group) -> torch.Tensor:
    """bool [S]: this rank is the lowest CP rank holding a token of the segment.

    Segments present nowhere are owned by no rank.
    """
    size, rank = group_size(group), group_rank(group)
    flat_ids = seg_ids.reshape(-1).long()
    present_S = torch.zeros(n_segments, dtype=torch.bool, device=seg_ids.device)
    present_S[flat_ids[flat_ids >= 0]] = True
    holder_S = torch.where(present_S, rank, size).to(torch.int64)
    all_reduce_(holder_S, group, ReduceOp.MIN)
    return holder_S == rank


@dataclass(frozen=True)
class CPContext:
    """What a loss needs to know about CP: the group and the full (padded) sequence length.

    Losses indexed by full-sequence positions (aligned chunks) use it to find the rows this rank
    holds (`local_rows`), to finish chunk-level sums over the CP group (`segment_sum`) and to
    count every chunk on exactly one rank (the holder of the row its term is computed at).
    `CPContext(None, seq_len)` is the single-process identity.
    """

    group: Group
    seq_len: int

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def positions(self, device=None) -> torch.Tensor:
        return cp_positions(self.seq_len, self.size, self.rank, device=device)

    def shard(self, x: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
        return to_cp_layout(x, cp_size=self.size, cp_rank=self.rank, dim=dim)

    def local_rows(self, flat_rows: torch.Tensor) -> torch.Tensor:
        return cp_local_rows(flat_rows, seq_len=self.seq_len, cp_size=self.size, cp_rank=self.rank)

    def segment_sum(self, values: torch.Tensor, seg_ids: torch.Tensor, n: int) -> torch.Tensor:
        return cp_segment_sum(values, seg_ids, n, self.group)
