"""The parallelism-invariance matrix: every loss x every TP x CP x DP layout (<= 4 processes).

For each (loss, layout): every rank builds the same global batch, computes the single-process
reference (the same loss with world size 1 on the whole batch: mean = sum / count, and the
gradient w.r.t. the full student logits), then its own shard: DP rows (uneven: 2 rows vs 1,
with different padding, so DP ranks hold different token counts), CP tokens in the load-balanced
layout, TP vocabulary slice. The local sum is divided by `global_count` (DP and CP only).
Checks: the summed objective over DP x CP equals the reference mean, the global count equals
the reference count, and this rank's gradient equals its slice of the reference gradient.

Losses come from `harness_losses` (written from the distributed ops) and, once it lands, from
tokenbridge/losses through the adapters in `LIBRARY_LOSSES`.
"""

from __future__ import annotations

import torch

from tests.dist.harness import ALL_LAYOUTS, Ctx, case
from tests.dist.harness_losses import LOSSES
from tokenbridge.dist_ops import global_count, next_token_targets
from tokenbridge.dist_ops.collectives import all_reduce_
from trainer.parallel.mesh import SINGLE

B, T, V, K, C = 3, 8, 16, 4, 8
LENGTHS = (8, 5, 7)  # real tokens per row; the rest is padding
MATRIX_LAYOUTS = [lay for lay in ALL_LAYOUTS if max(lay) <= 2]  # TP, CP, DP in {1, 2}


def make_batch(gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full single-process batch: student logits [B, T, V] and per-token / per-chunk tensors."""
    student = torch.randn(B, T, V, generator=gen) * 2.0
    teacher = torch.randn(B, T, V, generator=gen) * 2.0
    input_ids = torch.randint(0, V, (B, T), generator=gen)
    valid = torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    targets = next_token_targets(input_ids)
    targets = torch.where(valid & valid.roll(-1, 1), targets, -100)
    t_lp = torch.log_softmax(teacher, -1)
    topk_lp, topk_ids = t_lp.topk(K, -1)
    # alignment chunks of 1-3 tokens, monotone per row; -1 on padding
    chunk_ids = torch.full((B, T), -1)
    for b in range(B):
        lens = torch.randint(1, 4, (T,), generator=gen)
        ids_row = torch.repeat_interleave(torch.arange(T), lens)[:T]
        chunk_ids[b] = torch.where(valid[b], ids_row, -1)
    batch = {
        "input_ids": input_ids,
        "targets": targets,
        "teacher_logits": teacher,
        "teacher_topk_ids": topk_ids,
        "teacher_topk_logprobs": topk_lp,
        "chunk_ids": chunk_ids,
        "chunk_ids_full": chunk_ids,
        "teacher_chunk_logprobs": -torch.rand(B, C, generator=gen) * 6.0,
    }
    return student, batch


VOCAB_SHARDED = {"teacher_logits"}
PER_ROW = {"teacher_chunk_logprobs", "chunk_ids_full"}  # DP rows only, not split over CP


def _whole(x: torch.Tensor, *, vocab: bool, seq: bool = True) -> torch.Tensor:
    """The single-process 'shard' of a full-batch tensor: all of it."""
    return x


def check_invariance(ctx: Ctx, student: torch.Tensor, run) -> None:
    """`run(student, groups, shard) -> (sum, count)` on 1 process vs on this rank's shard.

    `shard(x, vocab=, seq=)` maps a full-batch tensor [B, T, ...] to what the loss sees: all of
    it for the reference, this rank's DP rows / CP tokens / TP slice otherwise (`Ctx.local`).
    """
    ref_leaf = student.clone().requires_grad_(True)
    ref_sum, ref_count = run(ref_leaf, SINGLE, _whole)
    ref_loss = ref_sum / ref_count
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_leaf)

    g = ctx.groups
    leaf = ctx.local(student, vocab=True).clone().requires_grad_(True)
    local_sum, local_count = run(leaf, g, ctx.local)
    count = global_count(local_count, dp_group=g.dp, cp_group=g.cp)
    local_loss = local_sum / count.to(local_sum.dtype)
    (grad,) = torch.autograd.grad(local_loss, leaf)
    total = local_loss.detach().clone()
    all_reduce_(total, g.dp)
    all_reduce_(total, g.cp)
    ctx.close("loss", total, ref_loss)
    ctx.close("count", count, torch.as_tensor(ref_count, dtype=torch.float64))
    ctx.close("grad", grad, ctx.local(ref_grad, vocab=True))
    ctx.check("reference has a gradient", ref_grad.abs().sum().item() > 0)


def _run_loss(loss_fn, ctx: Ctx) -> None:
    student, batch = make_batch(ctx.generator("batch"))

    def run(s, groups, shard):
        local = {
            k: shard(v, vocab=k in VOCAB_SHARDED, seq=k not in PER_ROW) for k, v in batch.items()
        }
        return loss_fn(s, local, groups)

    check_invariance(ctx, student, run)


def _name(layout: tuple[int, int, int]) -> str:
    return "tp{}cp{}dp{}".format(*layout)


for _loss_name, _fn in LOSSES.items():
    for _layout in MATRIX_LAYOUTS:
        case(f"loss_{_loss_name}_{_name(_layout)}", _layout)(lambda ctx, fn=_fn: _run_loss(fn, ctx))
