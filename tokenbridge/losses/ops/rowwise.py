"""Run a per-row computation over selected rows of a [N, V] logits tensor, block by block.

This keeps the composed loss path (under TP, and where no fused Function exists) memory-lean:
each block runs under non-reentrant activation checkpointing, so the peak is the logits, their
gradient and ONE block's fp32 intermediates, whatever T is (docs/losses.md, "Memory and speed").

Legend: N rows of the logits, V vocabulary, G selected rows, c block rows, r selected in a block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tokenbridge.losses.ops.head_logits import HeadLogits, ScaleGrad, project

DEFAULT_CHUNK = 256


def take_rows(block_cV: Tensor, local_r: Tensor) -> Tensor:
    """The selected rows of a block; the block itself (no copy) when every row is selected."""
    if local_r.numel() == block_cV.shape[0]:
        return block_cV
    return block_cV[local_r]  # advanced indexing: several times faster than index_select on CPU


def map_rows(
    fn: Callable[..., tuple[Tensor, ...]],
    logits_NV: Tensor,
    rows_G: Tensor,
    *extras: Tensor,
    chunk_size: int = DEFAULT_CHUNK,
    recompute: bool = True,
) -> tuple[Tensor, ...]:
    """Apply ``fn`` to the rows ``rows_G`` (sorted ascending, distinct) of ``logits_NV`` in blocks.

    ``fn(block_cV, local_rows_r, *extras_r) -> tuple[Tensor, ...]`` gets the block, the indices
    of the selected rows inside it (sorted, distinct) and the matching slices of the per-row
    ``extras``, and returns per-row tensors (first dim r). Returns the concatenation of ``fn``'s
    outputs, in the order of ``rows_G``. The caller handles G == 0 (there is nothing to
    concatenate). A `HeadLogits` is projected inside ``fn``'s checkpoint, block by block, so
    the [N, V] logits and their gradient never exist; ``fn`` then sees exactly the selected rows.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if isinstance(logits_NV, HeadLogits):
        chunk_size = logits_NV.chunk
    n_rows = logits_NV.shape[0]
    if rows_G.numel() == 0:
        raise ValueError("map_rows needs at least one selected row")
    if rows_G.numel() > 1 and bool((rows_G[1:] <= rows_G[:-1]).any()):
        raise ValueError("map_rows needs sorted, distinct rows")
    if int(rows_G[0]) < 0 or int(rows_G[-1]) >= n_rows:
        raise ValueError(f"selected rows must lie in [0, {n_rows})")
    for e in extras:
        if e.shape[0] != rows_G.shape[0]:
            raise ValueError(
                f"extra of shape {tuple(e.shape)} does not match {rows_G.numel()} rows"
            )
    starts = torch.arange(0, n_rows + chunk_size, chunk_size, device=rows_G.device)
    bounds = torch.searchsorted(rows_G, starts).tolist()
    wants_grad = torch.is_grad_enabled() and (
        logits_NV.requires_grad or any(e.requires_grad for e in extras)
    )
    if isinstance(logits_NV, HeadLogits):
        return _map_head_rows(fn, logits_NV, rows_G, bounds, extras, recompute and wants_grad)
    parts: list[tuple[Tensor, ...]] = []
    # split ONCE: one autograd node, so backward assembles the [N, V] gradient in one allocation
    # (slicing or index_select per block would allocate a zero [N, V] gradient per block)
    for i, block in enumerate(logits_NV.split(chunk_size, dim=0)):
        lo, hi = bounds[i], bounds[i + 1]
        if lo == hi:
            continue
        local = rows_G[lo:hi] - i * chunk_size
        sliced = [e[lo:hi] for e in extras]
        if recompute and wants_grad:
            out = checkpoint(fn, block, local, *sliced, use_reentrant=False)
        else:
            out = fn(block, local, *sliced)
        parts.append(out)
    return tuple(torch.cat(cols, dim=0) for cols in zip(*parts))


def _map_head_rows(
    fn: Callable[..., tuple[Tensor, ...]],
    head: HeadLogits,
    rows_G: Tensor,
    bounds: list[int],
    extras: tuple[Tensor, ...],
    recompute: bool,
) -> tuple[Tensor, ...]:
    """`map_rows` over a `HeadLogits`: the block's selected rows of the hidden states are
    projected inside the (checkpointed) function, so only [r, V] exists at a time."""
    hidden_NH = head.hidden
    picked = hidden_NH[rows_G]  # [G, H]: one gather node, its gradient assembled once
    softcap = head.softcap
    scale_G = None if head.row_scale is None else head.row_scale.reshape(-1)[rows_G]

    def run(h_rH, w_VH, s_r, *sliced):
        x = project(h_rH, w_VH, softcap=softcap)
        if s_r is not None:  # the rows' gradient scaled (`HeadLogits.row_scale`)
            x = ScaleGrad.apply(x, s_r)
        return fn(x, torch.arange(x.shape[0], device=x.device), *sliced)

    parts: list[tuple[Tensor, ...]] = []
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        if lo == hi:
            continue
        sliced = [e[lo:hi] for e in extras]
        s_r = None if scale_G is None else scale_G[lo:hi]
        if recompute:
            out = checkpoint(run, picked[lo:hi], head.weight, s_r, *sliced, use_reentrant=False)
        else:
            out = run(picked[lo:hi], head.weight, s_r, *sliced)
        parts.append(out)
    return tuple(torch.cat(cols, dim=0) for cols in zip(*parts))
