"""Student next-token cross entropy, and the per-position target log-probs other modes build on.

`ce` is the plain NLL of the realised next token: sum over target positions, count = targets.
`target_logprobs` returns log q(target) at selected positions with gradient; `alm`, `gold` and
`xtoken`'s chain term sum it over aligned chunks (`segments.segment_sum`).

Legend: B batch, T student positions, V student lm_head width, G selected positions.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor

from tokenbridge.dist_ops import vocab_ops
from tokenbridge.losses.base import LossOutput, as_count, compute_dtype, zero_sum_like
from tokenbridge.losses.ops.fused import logprobs_at_rows
from tokenbridge.losses.ops.rowwise import DEFAULT_CHUNK, map_rows, take_rows


def _target_block(block_cV, local_r, targets_r, *, vocab_size, temperature, tp_group):
    """The vocab-parallel composition (with a tp_group); the single-device path is fused."""
    x = take_rows(block_cV, local_r).to(compute_dtype(block_cV))
    x = vocab_ops.mask_padded(x, vocab_size, tp_group=tp_group)
    if temperature != 1.0:
        x = x / temperature
    logz = vocab_ops.logsumexp(x, tp_group)
    tgt = vocab_ops.gather(x, targets_r[:, None], tp_group)[:, 0]
    top = vocab_ops.max_value(x.detach(), tp_group)
    return tgt - logz, (tgt.detach() >= top).to(tgt.dtype)


def target_logprobs(
    logits_NV: Tensor,
    rows_G: Tensor,
    targets_G: Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
) -> tuple[Tensor, Tensor]:
    """(log q(target) [G] differentiable, target is an argmax [G] as 0/1) at rows ``rows_G``
    (sorted)."""
    if rows_G.numel() == 0:
        z = zero_sum_like(logits_NV)
        return z.expand(0), z.detach().expand(0)
    if tp_group is None:
        lp, _, top = logprobs_at_rows(
            logits_NV,
            rows_G,
            targets_G[:, None],
            vocab_size=vocab_size,
            temperature=temperature,
            chunk_size=chunk_size,
        )
        return lp[:, 0], (lp[:, 0].detach() >= top).to(lp.dtype)
    fn = partial(_target_block, vocab_size=vocab_size, temperature=temperature, tp_group=tp_group)
    return map_rows(fn, logits_NV, rows_G, targets_G, chunk_size=chunk_size)


def ce(
    student_logits_BTV: Tensor,
    targets_BT: Tensor,
    *,
    vocab_size: int,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
) -> LossOutput:
    """sum over target positions of -log q(target); count = number of targets (targets >= 0).

    ``targets_BT`` is the token each position predicts (`segments.shift_targets`), -1 = none.
    """
    b, t, width = student_logits_BTV.shape
    if tuple(targets_BT.shape) != (b, t):
        raise ValueError(f"ce: targets must be {(b, t)}, got {tuple(targets_BT.shape)}")
    if bool((targets_BT >= vocab_size).any()):
        raise ValueError(f"ce: a target id is >= student vocab_size {vocab_size}")
    flat_targets = targets_BT.reshape(-1).long()
    rows = (flat_targets >= 0).nonzero().squeeze(1)
    logits = student_logits_BTV.reshape(b * t, width)
    count = as_count(rows.numel(), logits.device)
    if rows.numel() == 0:
        return LossOutput(zero_sum_like(logits), count, {"ce_correct": count * 0})
    logq, hit = target_logprobs(
        logits,
        rows,
        flat_targets[rows],
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        tp_group=tp_group,
    )
    total = -logq.sum()
    return LossOutput(total, count, {"ce_sum": total.detach(), "ce_correct": hit.sum().long()})
