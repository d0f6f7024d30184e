"""Shared plumbing of the vocab-parallel ops: shard geometry, row chunks, global max and sums.

`vocab_parallel`, `vocab_parallel_xent` and `sampling` all walk the rows of a vocab-sharded
tensor in chunks and reduce each over the TP group with the same two collectives; one chunk loop
keeps every TP rank issuing the same collectives in the same order (else the ops deadlock).
Shards must be equal (pad the lm_head to a multiple of the TP size) over the same rows.

Legend: N rows, V local vocab columns, K ids per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp

from tokenbridge.dist_ops.collectives import Group, all_reduce_, group_rank, group_size

DEFAULT_CHUNK_ELEMENTS = 1 << 23
"""Auto chunk: rows * V_local ~ 8M elements = 32 MiB per fp32 temporary of the chunk."""


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's vocabulary slice sits in the global vocabulary."""

    group: Group
    size: int
    rank: int
    v_local: int

    @property
    def offset(self) -> int:
        return self.rank * self.v_local

    @property
    def v_global(self) -> int:
        return self.size * self.v_local

    def localize(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ids -> (local column clamped into range, mask of ids this shard owns).

        Ids outside [0, V) (e.g. -1 padding or -100 ignore) are owned by no shard.
        """
        local = ids.long() - self.offset
        inside = (local >= 0) & (local < self.v_local)
        return local.clamp(0, self.v_local - 1), inside


def vocab_shard(group: Group, v_local: int) -> VocabShard:
    if v_local < 1:
        raise ValueError(f"vocab shard must have at least one column, got V_local={v_local}")
    return VocabShard(group=group, size=group_size(group), rank=group_rank(group), v_local=v_local)


def check_temperature(temperature: float) -> None:
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def rowwise(
    fn, logits: torch.Tensor, group: Group, *, temperature: float, chunk_size: int | None
) -> torch.Tensor:
    """``fn`` (an autograd Function of [N, V_local] rows, the group, chunk size, temperature)
    on ``logits`` [..., V_local] seen as rows; its [N] or [N, V_local] output keeps the leading
    dims ([...] or [..., V_local])."""
    check_temperature(temperature)
    out = fn.apply(as_rows(logits), group, chunk_size, temperature)
    return out.reshape(*logits.shape[:-1], *out.shape[1:])


def chunk_spans(n_rows: int, v_local: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """[start, end) row ranges. `chunk_size=None` picks rows so a chunk has ~8M elements.

    Depends only on (n_rows, v_local, chunk_size), which are equal on every TP rank, so all
    ranks walk the same chunks and issue the same collectives.
    """
    if chunk_size is None:
        rows = max(1, DEFAULT_CHUNK_ELEMENTS // v_local)
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    else:
        rows = chunk_size
    return [(s, min(s + rows, n_rows)) for s in range(0, n_rows, rows)]


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [N, V] (a view when `x` is contiguous)."""
    return x.reshape(-1, x.shape[-1])


def ids_as_rows(ids: torch.Tensor, lead: torch.Size) -> tuple[torch.Tensor, bool]:
    """Ids [...] or [..., K] matching the logits' leading dims -> ([N, K], had_k_dim)."""
    if ids.shape == lead:
        return ids.reshape(-1, 1), False
    if ids.dim() == len(lead) + 1 and ids.shape[:-1] == lead:
        return ids.reshape(-1, ids.shape[-1]), True
    raise ValueError(
        f"ids must have shape {tuple(lead)} or {tuple(lead)} + (K,), got {tuple(ids.shape)}"
    )


def workspace(spans: list[tuple[int, int]], v: int, device, count: int = 1) -> list[torch.Tensor]:
    """`count` fp32 [largest chunk, V] buffers, reused by every chunk of one op call.

    Allocating per chunk would map fresh pages (and fault them in) for every chunk; one buffer
    per role keeps the loop allocation-free on the [chunk, V] scale.
    """
    rows = max((e - s for s, e in spans), default=0)
    return [torch.empty((rows, v), dtype=torch.float32, device=device) for _ in range(count)]


def backward_chunks(
    logits_NV: torch.Tensor, chunk_size: int | None, *, count: int = 1
) -> tuple[torch.Tensor, list[tuple[int, int]], list[torch.Tensor]]:
    """What every chunked backward starts with: the gradient to fill (like the logits), the row
    chunks it is computed in, and ``count`` fp32 chunk buffers (`workspace`)."""
    grad_NV = torch.empty_like(logits_NV)
    n, v = logits_NV.shape
    spans = chunk_spans(n, v, chunk_size)
    return grad_NV, spans, workspace(spans, v, logits_NV.device, count=count)


def upcast(chunk: torch.Tensor, temperature: float, buf: torch.Tensor) -> torch.Tensor:
    """A PRIVATE fp32 copy of a logits chunk (in `buf`) divided by the temperature.

    Private even for fp32 input, so the ops may work on it in place: each in-place step saves
    a [chunk, V] allocation and a pass over memory.
    """
    z = buf[: chunk.shape[0]].copy_(chunk)
    return z.div_(temperature) if temperature != 1.0 else z


def finite_(z: torch.Tensor) -> torch.Tensor:
    """In place: -inf -> the most negative finite float, so 0 * z is 0 (not NaN) downstream."""
    return z.clamp_(min=torch.finfo(z.dtype).min)


def row_dot(a_NV: torch.Tensor, b_NV: torch.Tensor) -> torch.Tensor:
    """[N] per-row dot products, without materialising a * b (a batched matrix product)."""
    return torch.bmm(a_NV.unsqueeze(1), b_NV.unsqueeze(2)).reshape(-1)


def global_max(z_NV: torch.Tensor, group: Group) -> torch.Tensor:
    """Row max over the whole vocabulary, detached (it only stabilises exp; lse is invariant).

    Rows that are -inf everywhere get 0 so that exp(z - max) stays 0 instead of NaN.
    """
    m_N = z_NV.detach().amax(dim=-1)
    all_reduce_(m_N, group, ReduceOp.MAX)
    return torch.where(torch.isfinite(m_N), m_N, torch.zeros_like(m_N))


def global_sums(group: Group, *parts: torch.Tensor) -> list[torch.Tensor]:
    """All-reduce (sum) several per-row tensors [N] or [N, K] (N >= 1) in ONE collective."""
    n = parts[0].shape[0]
    flat = torch.cat([p.reshape(n, -1) for p in parts], dim=1)
    all_reduce_(flat, group)
    out, start = [], 0
    for p in parts:
        width = p.numel() // n
        out.append(flat[:, start : start + width].reshape(p.shape))
        start += width
    return out
