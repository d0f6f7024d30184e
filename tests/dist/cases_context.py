"""Multi-process cases: context-parallel ops, packed sequences and the loss divisor.

CP objective convention: the total is the SUM over CP ranks of each rank's local term, so each
rank's gradient must equal its tokens' slice of the dense gradient of the summed objective.
"""

from __future__ import annotations

import torch

from tests.dist.harness import Ctx, case
from tokenbridge.dist_ops import (
    cp_all_gather,
    cp_segment_owner,
    cp_segment_sum,
    cp_shift_next,
    global_count,
    next_token_targets,
    packed_cp_positions,
    packed_logprobs,
    to_cp_layout,
)
from tokenbridge.dist_ops.collectives import all_reduce_

CP_LAYOUTS = {2: (1, 2, 2), 4: (1, 4, 1)}


def _cp_local(ctx: Ctx, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return to_cp_layout(x, cp_size=ctx.cp, cp_rank=ctx.groups.cp_rank, dim=dim)


def _all_gather(ctx: Ctx) -> None:
    g = ctx.groups.cp
    x = torch.randn(2, 8 * ctx.cp, 3, generator=ctx.generator("x"))
    w_ranks = torch.randn(ctx.cp, *x.shape, generator=ctx.generator("w"))
    leaf = _cp_local(ctx, x).clone().requires_grad_(True)
    full = cp_all_gather(leaf, g)
    ctx.close("all_gather value", full, x)
    # rank r's term uses the whole gathered tensor with its own weights: the total gradient is
    # the sum of every rank's weights (the reduce-scatter backward)
    (grad,) = torch.autograd.grad((full * w_ranks[ctx.groups.cp_rank]).sum(), leaf)
    ctx.close("all_gather grad", grad, _cp_local(ctx, w_ranks.sum(0)))
    seq_first = torch.randn(8 * ctx.cp, 2, generator=ctx.generator("dim0"))
    ctx.close("dim=0", cp_all_gather(_cp_local(ctx, seq_first, 0), g, dim=0), seq_first)


def _shift(ctx: Ctx) -> None:
    g = ctx.groups.cp
    x = torch.randn(3, 4 * ctx.cp, 2, generator=ctx.generator("x"))
    w = torch.randn(x.shape, generator=ctx.generator("w"))
    ref = x.detach().clone().requires_grad_(True)
    ref_y = next_token_targets(ref, fill=0.0)
    (ref_grad,) = torch.autograd.grad((ref_y * w).sum(), ref)
    leaf = _cp_local(ctx, x).clone().requires_grad_(True)
    y = cp_shift_next(leaf, g, fill=0.0)
    ctx.close("shift value", y, _cp_local(ctx, ref_y))
    (grad,) = torch.autograd.grad((y * _cp_local(ctx, w)).sum(), leaf)
    ctx.close("shift grad", grad, _cp_local(ctx, ref_grad))
    ids = torch.randint(0, 50, (2, 4 * ctx.cp), generator=ctx.generator("ids"))
    shifted = cp_shift_next(_cp_local(ctx, ids), g, fill=-100)
    ctx.check(
        "shifted ids == data-side targets",
        torch.equal(shifted, _cp_local(ctx, next_token_targets(ids))),
    )


def _segments(ctx: Ctx) -> None:
    g = ctx.groups.cp
    seq = 4 * ctx.cp
    lengths = torch.randint(1, 4, (seq,), generator=ctx.generator("len"))
    seg = torch.repeat_interleave(torch.arange(seq), lengths)[:seq].reshape(1, seq)
    seg[0, -2:] = -1  # tokens outside any chunk (specials, padding)
    n_seg = int(seg.max()) + 3  # trailing segments present nowhere
    vals = torch.randn(1, seq, generator=ctx.generator("v"))
    target = torch.randn(n_seg, generator=ctx.generator("t"))
    ref = vals.clone().requires_grad_(True)
    ref_sums = torch.zeros(n_seg).index_add(0, seg[0][seg[0] >= 0], ref[0][seg[0] >= 0])
    present = torch.zeros(n_seg, dtype=torch.bool)
    present[seg[seg >= 0]] = True
    ref_loss = (((ref_sums - target) ** 2) * present).sum()  # absent segments have no owner
    (ref_grad,) = torch.autograd.grad(ref_loss, ref)
    leaf = _cp_local(ctx, vals).clone().requires_grad_(True)
    seg_local = _cp_local(ctx, seg)
    sums = cp_segment_sum(leaf, seg_local, n_seg, g)
    owner = cp_segment_owner(seg_local, n_seg, g)
    local_loss = (((sums - target) ** 2) * owner).sum()
    (grad,) = torch.autograd.grad(local_loss, leaf)
    total = all_reduce_(local_loss.detach().clone(), g)
    owners = all_reduce_(owner.long(), g)
    ctx.close("segment sums", sums, ref_sums)
    ctx.close("segment loss counted once", total, ref_loss)
    ctx.close("segment grad", grad, _cp_local(ctx, ref_grad))
    ctx.check("each present segment has one owner", torch.equal(owners, present.long()))


for _cp, _layout in CP_LAYOUTS.items():
    case(f"cp{_cp}_all_gather", _layout)(_all_gather)
    case(f"cp{_cp}_shift_next", _layout)(_shift)
    case(f"cp{_cp}_segment_sum_owner", _layout)(_segments)


@case("tp2_cp2_packed_logprobs", (2, 2, 1))
def _packed(ctx: Ctx) -> None:
    tpg, cpg = ctx.groups.tp, ctx.groups.cp
    cu = torch.tensor([0, 5, 6, 13])
    cu_pad = torch.tensor([0, 8, 12, 20])  # each sequence padded to a multiple of 2 * CP
    v = 10
    ids = torch.randint(0, v, (20,), generator=ctx.generator("ids"))
    logits = torch.randn(20, v, generator=ctx.generator("z"))
    w_tok = torch.randn(20, generator=ctx.generator("w"))
    # dense reference: per sequence, sum of next-token log-probs over its real tokens
    ref = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(ref.double(), -1)
    ref_tok, ref_sums = torch.zeros(20, dtype=torch.float64), []
    for s in range(3):
        start, real = int(cu_pad[s]), int(cu[s + 1] - cu[s])
        t = torch.arange(start, start + real - 1)
        ref_tok = ref_tok.index_put((t,), logp[t, ids[t + 1]])
        ref_sums.append(
            logp[t, ids[t + 1]].sum() if real > 1 else torch.zeros((), dtype=torch.float64)
        )
    ref_sums = torch.stack(ref_sums)
    ref_loss = (ref_sums**2).sum() + (ref_tok * w_tok).sum()
    (ref_grad,) = torch.autograd.grad(ref_loss, ref)
    pos = packed_cp_positions(cu_pad, ctx.cp, ctx.groups.cp_rank)
    leaf = ctx.tp_slice(logits[pos]).clone().requires_grad_(True)
    out = packed_logprobs(
        leaf, ids, cu, tp_group=tpg, cp_group=cpg, cu_seqlens_padded=cu_pad, chunk_size=3
    )
    ctx.close("packed seq sums", out.seq_sums, ref_sums)
    ctx.close("packed token logprobs", out.token_logprobs, ref_tok[pos])
    local_loss = (out.seq_sums**2 * out.seq_owner).sum() + (out.token_logprobs * w_tok[pos]).sum()
    (grad,) = torch.autograd.grad(local_loss, leaf)
    ctx.close("packed grad", grad, ctx.tp_slice(ref_grad[pos]))
    ctx.close("packed total", all_reduce_(local_loss.detach().clone(), cpg), ref_loss)


def _count(ctx: Ctx) -> None:
    # the count depends on the DP and CP coordinates only (TP ranks hold the same tokens)
    mine = 1 + ctx.groups.dp_rank * 10 + ctx.groups.cp_rank * 100
    expected = sum(1 + d * 10 + c * 100 for d in range(ctx.dp) for c in range(ctx.cp))
    got = global_count(torch.tensor(mine), dp_group=ctx.groups.dp, cp_group=ctx.groups.cp)
    ctx.check(f"global count {got.item()} != {expected}", got.item() == expected)
    ctx.check("via ParallelGroups", ctx.groups.global_count(mine).item() == expected)


case("global_count_tp2_dp2", (2, 1, 2))(_count)
case("global_count_tp2_cp2", (2, 2, 1))(_count)
case("global_count_cp2_dp2", (1, 2, 2))(_count)
