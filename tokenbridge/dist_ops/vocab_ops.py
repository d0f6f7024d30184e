"""The few reductions over the vocabulary dimension that every loss goes through.

Each takes the (local) logits and an optional ``tp_group``: plain torch without one, the vp_*
ops of `tokenbridge.dist_ops` with one (imported lazily: this package must import without
torch.distributed set up). Keeping the list this short is what lets every mode run on a sharded
vocabulary unchanged. Ids are GLOBAL; an id < 0 is an empty slot (reads -inf, excludes nothing);
inputs are already scaled by 1/temperature and masked (`mask_padded`).

Legend: N rows, V (local) vocabulary columns, K ids per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def _vp():
    from tokenbridge import dist_ops  # re-exports every vp_* op

    return dist_ops


def vocab_offset(x: Tensor, tp_group=None) -> int:
    """Global id of local column 0."""
    if tp_group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(tp_group) * x.shape[-1]


def mask_padded(x_NV: Tensor, vocab_size: int, *, tp_group=None) -> Tensor:
    """Columns >= vocab_size (lm_head padding beyond the tokenizer) set to -inf; no copy if none."""
    offset = vocab_offset(x_NV, tp_group)
    width = x_NV.shape[-1]
    if offset + width <= vocab_size:
        return x_NV
    cols = torch.arange(width, device=x_NV.device) + offset
    return x_NV.masked_fill(cols >= vocab_size, NEG_INF)


def log_softmax(x_NV: Tensor, tp_group=None) -> Tensor:
    if tp_group is None:
        return torch.log_softmax(x_NV, dim=-1)
    return _vp().vp_log_softmax(x_NV, tp_group)


def logsumexp(x_NV: Tensor, tp_group=None) -> Tensor:
    """[N]: log of the partition function over the (whole, all shards) vocabulary."""
    if tp_group is None:
        return torch.logsumexp(x_NV, dim=-1)
    return _vp().vp_logsumexp(x_NV, tp_group)


def max_value(x_NV: Tensor, tp_group=None) -> Tensor:
    """[N]: the largest value of each row over the whole vocabulary (no gradient)."""
    top = x_NV.detach().amax(dim=-1)
    if tp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    return top


def gather(x_NV: Tensor, ids: Tensor, tp_group=None) -> Tensor:
    """Values at global ids: ``ids`` is [K] (same columns for every row) or [N, K]; ids < 0 -> -inf."""
    valid = ids >= 0
    safe = ids.clamp(min=0)
    if tp_group is not None:
        if safe.dim() == 1:
            safe = safe.expand(x_NV.shape[0], -1)
        vals = _vp().vp_gather(x_NV, safe, tp_group)
    elif safe.dim() == 1:
        vals = x_NV.index_select(-1, safe)
    else:
        vals = x_NV.gather(-1, safe)
    return vals.masked_fill(~valid, NEG_INF)


def exclude_columns(x_NV: Tensor, ids: Tensor, tp_group=None) -> Tensor:
    """A copy of x with the global columns ``ids`` ([K] shared or [N, K]; ids < 0 ignored) at -inf."""
    offset = vocab_offset(x_NV, tp_group)
    width = x_NV.shape[-1]
    local = ids - offset
    inside = (ids >= 0) & (local >= 0) & (local < width)
    if ids.dim() == 1:
        return x_NV.index_fill(-1, local[inside], NEG_INF)
    # one spare column takes the writes of empty or out-of-shard slots
    y = torch.nn.functional.pad(x_NV, (0, 1), value=NEG_INF)
    return y.scatter(-1, torch.where(inside, local, width), NEG_INF)[..., :width]


def logsumexp_excluding(x_NV: Tensor, ids: Tensor, tp_group=None) -> Tensor:
    """[N]: logsumexp over the columns NOT in ``ids`` ([K] shared or [N, K]; ids < 0 ignored).

    Computed exactly on a masked copy rather than as log(1 - sum p_ids): that subtraction loses all
    precision when the ids hold almost all the mass, and a tail of exactly 0 would make a KL
    infinite.
    """
    return logsumexp(exclude_columns(x_NV, ids, tp_group), tp_group)


def topk(x_NV: Tensor, k: int, tp_group=None) -> tuple[Tensor, Tensor]:
    """(values [N, k], global ids [N, k] int64), largest first."""
    if tp_group is None:
        return torch.topk(x_NV, k, dim=-1)
    return _vp().vp_topk(x_NV, k, tp_group)


def entropy(x_NV: Tensor, tp_group=None) -> Tensor:
    """[N]: entropy of softmax(x) in nats; -inf columns contribute 0."""
    if tp_group is not None:
        return _vp().vp_entropy(x_NV, tp_group)
    logp = torch.log_softmax(x_NV, dim=-1)
    keep = logp > NEG_INF
    logp = torch.where(keep, logp, 0.0)
    return -torch.where(keep, logp.exp() * logp, 0.0).sum(-1)


def soft_ce(x_NV: Tensor, target_probs_NV: Tensor, tp_group=None) -> Tensor:
    """[N]: -sum_v t_v log softmax(x)_v; target zeros contribute 0 even where x is -inf.

    With a tp_group, ``target_probs_NV`` is the local shard of the targets.
    """
    if tp_group is not None:
        return _vp().vp_soft_ce(x_NV, target_probs_NV, tp_group)
    logp = torch.log_softmax(x_NV, dim=-1)
    keep = target_probs_NV > 0
    return -torch.where(keep, target_probs_NV * torch.where(keep, logp, 0.0), 0.0).sum(-1)
