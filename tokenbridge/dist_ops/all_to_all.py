"""All-to-all between the vocab-parallel and the sequence-parallel layouts of a TP group.

For losses that want whole vocabulary rows: a vocab shard of every row becomes the whole
vocabulary of N / TP rows, each element moved once. Afterwards the TP ranks hold different rows,
so the objective is a SUM over TP too (docs/parallelism.md, "The distributed loss ops").

Legend: N rows, V vocab (local or global), P = TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenbridge.dist_ops.collectives import Group, group_size


def _vocab_to_seq(x_NV: torch.Tensor, group: Group) -> torch.Tensor:
    size = group_size(group)
    n, v_local = x_NV.shape
    recv_PnV = torch.empty_like(x_NV)
    # send row block p to rank p; receive from rank p its vocab slice of my row block
    dist.all_to_all_single(recv_PnV, x_NV.contiguous(), group=group)
    recv_PnV = recv_PnV.view(size, n // size, v_local)
    return recv_PnV.permute(1, 0, 2).reshape(n // size, size * v_local)


def _seq_to_vocab(y_nV: torch.Tensor, group: Group) -> torch.Tensor:
    size = group_size(group)
    n_local, v = y_nV.shape
    send_PnV = y_nV.view(n_local, size, v // size).permute(1, 0, 2).contiguous()
    recv = torch.empty_like(send_PnV)
    dist.all_to_all_single(recv, send_PnV, group=group)
    return recv.reshape(n_local * size, v // size)


# the backward of each layout change is the other one applied to the gradient
class _VocabToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NV, group):
        ctx.group = group
        return _vocab_to_seq(x_NV, group)

    @staticmethod
    def backward(ctx, g_nV):
        return _seq_to_vocab(g_nV.contiguous(), ctx.group), None


class _SeqToVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_nV, group):
        ctx.group = group
        return _seq_to_vocab(y_nV.contiguous(), group)

    @staticmethod
    def backward(ctx, g_NV):
        return _vocab_to_seq(g_NV, ctx.group), None


def _checked_apply(
    fn, x: torch.Tensor, group: Group, *, layout: str, axis: int, what: str, hint: str = ""
) -> torch.Tensor:
    """``fn`` applied to a 2-D ``x`` (``layout``) whose dimension ``axis`` (``what``) splits
    evenly over the TP group; the identity for a group of one."""
    size = group_size(group)
    if x.dim() != 2:
        raise ValueError(f"expected {layout}, got shape {tuple(x.shape)}")
    if size == 1:
        return x
    if x.shape[axis] % size:
        raise ValueError(f"{what}={x.shape[axis]} must be divisible by TP={size}{hint}")
    return fn.apply(x, group)


def vocab_to_seq_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[N, V / TP] vocab shard of all rows -> [N / TP, V] full vocab of this rank's row block."""
    return _checked_apply(
        _VocabToSeq, x, group, layout="[N, V_local]", axis=0, what="rows N", hint="; pad them"
    )


def seq_to_vocab_parallel(y: torch.Tensor, group: Group) -> torch.Tensor:
    """[N / TP, V] full vocab of this rank's row block -> [N, V / TP] vocab shard of all rows."""
    return _checked_apply(_SeqToVocab, y, group, layout="[N / TP, V]", axis=1, what="vocab V")
