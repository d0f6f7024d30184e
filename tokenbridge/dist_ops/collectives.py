"""Process groups and the autograd-aware collectives every distributed loss op is built from.

Two conventions, because the groups mean different things for the objective: replicated over
TP (an all-reduce with an identity backward), summed over CP and DP (an all-reduce with an
all-reduce backward). `global_count` is the divisor of `tokenbridge.losses.base.normalize`.
A group of `None` (or torch.distributed not initialised) is world size 1: plain local ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

Group = ProcessGroup | None


def group_size(group: Group) -> int:
    """World size of `group`; 1 for `None` or when torch.distributed is not initialised."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside `group`; 0 for `None`."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def all_reduce_(tensor: torch.Tensor, group: Group, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce outside autograd; a no-op for world size 1."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather_stack(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather outside autograd: returns [world, *tensor.shape] in rank order."""
    size = group_size(group)
    if size == 1:
        return tensor.unsqueeze(0)
    flat = tensor.reshape(1, -1) if tensor.dim() == 0 else tensor.contiguous()
    # the output is the ranks' inputs concatenated along dim 0 (what gloo and NCCL expect)
    out = torch.empty((size * flat.shape[0], *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    dist.all_gather_single(out, flat, group=group)
    return out.view(size, *tensor.shape)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks whose objective is itself summed over ranks (CP, DP): backward all-reduces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Sum over TP ranks whose objective is replicated: backward is the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """A replicated input whose uses are split over TP ranks: backward sums their gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's "copy to the TP region").

    For an input every TP rank holds whole (the lm_head's hidden states) that each rank
    multiplies by its own vocabulary shard: each rank's gradient is the part from its shard,
    and the input's gradient is their sum.
    """
    if group_size(group) == 1:
        return x
    return _CopyToGroup.apply(x, group)


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Differentiable sum over a CP/DP group (objective = sum of the ranks' local terms).

    Forward: every rank gets sum_r x_r. Backward: dL/dx_r = sum over ranks of the incoming
    gradients (an all-reduce), because every rank's local term may depend on the sum.
    """
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Differentiable sum over a TP group (objective replicated on every TP rank).

    Forward: every rank gets sum_r x_r. Backward: the identity (each rank's copy of the
    replicated objective already carries the whole gradient for its own partial term).
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def global_count(
    count: torch.Tensor | int | float, *, dp_group: Group, cp_group: Group
) -> torch.Tensor:
    """The loss divisor of `tokenbridge.losses.base.normalize`: `count` summed over the DP and
    CP ranks, never over TP ranks. A detached tensor (float64: exact integer sums up to 2**53)."""
    if isinstance(count, torch.Tensor):
        total = count.detach().to(torch.float64).clone()
    else:
        total = torch.tensor(float(count), dtype=torch.float64)
    all_reduce_(total, dp_group)
    all_reduce_(total, cp_group)
    return total
