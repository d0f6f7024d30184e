"""`kd_topk`: same-tokenizer distillation over the teacher's top-k ids plus a tail bucket.

Both tails are exact, so every term is a proper divergence over k + 1 categories at O(T K)
transport. ``support="columns"`` scores the student's own top-k instead (the on-policy core).
Formulas: docs/losses.md, "`kd_topk`".

Legend: B batch, T positions, V student lm_head width, K support size, G distilled positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from tokenbridge.dist_ops import vocab_ops
from tokenbridge.losses.base import (
    LossOutput,
    as_count,
    check_divergence,
    check_option,
    compute_dtype,
    divergence_terms,
    empty_loss,
)
from tokenbridge.losses.ops.fused import logprobs_at_rows
from tokenbridge.losses.ops.rowwise import DEFAULT_CHUNK, map_rows, take_rows
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec


@dataclass(frozen=True)
class KDTopKConfig:
    k: int = 64
    divergence: str = "forward"  # forward | reverse | jsd
    beta: float = 0.5  # jsd only
    temperature: float = 1.0
    support: str = "teacher"  # teacher (teacher's top-k) | columns (on-policy: given ids)

    def __post_init__(self) -> None:
        check_divergence(self)
        check_option(self, "k", self.k >= 1, ">= 1")
        check_option(self, "temperature", self.temperature > 0, "> 0")
        check_option(self, "support", self.support in ("teacher", "columns"), "teacher or columns")


def kd_topk_teacher_spec(config: KDTopKConfig, *, teacher_vocab_size: int) -> TeacherOutputSpec:
    if config.support == "teacher":
        return TeacherOutputSpec(teacher_vocab_size, topk=config.k, temperature=config.temperature)
    return TeacherOutputSpec(
        teacher_vocab_size,
        columns=config.k,
        per_position_columns=True,
        temperature=config.temperature,
    )


@torch.no_grad()
def student_topk_ids(
    student_logits_BTV: Tensor,
    k: int,
    *,
    vocab_size: int,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
) -> Tensor:
    """int32 [B, T, k]: the student's own top-k ids (no grad), for the teacher to score."""
    b, t, width = student_logits_BTV.shape
    flat = student_logits_BTV.reshape(b * t, width)
    out = []
    for block in flat.split(chunk_size):
        x = vocab_ops.mask_padded(block.float(), vocab_size, tp_group=tp_group)
        out.append(vocab_ops.topk(x, k, tp_group)[1])
    return torch.cat(out).reshape(b, t, k).to(torch.int32)


def _kd_block(block_cV, local_r, ids_rK, logp_rK1, *, config, vocab_size, tp_group):
    """The vocab-parallel composition (with a tp_group); the single-device path is fused."""
    x = take_rows(block_cV, local_r).to(compute_dtype(block_cV))
    x = vocab_ops.mask_padded(x, vocab_size, tp_group=tp_group)
    if config.temperature != 1.0:
        x = x / config.temperature
    logz = vocab_ops.logsumexp(x, tp_group)[:, None]
    logq = torch.cat(
        [
            vocab_ops.gather(x, ids_rK, tp_group) - logz,
            vocab_ops.logsumexp_excluding(x, ids_rK, tp_group)[:, None] - logz,
        ],
        dim=-1,
    )
    return divergence_terms(logp_rK1, logq, config)


def kd_topk(
    student_logits_BTV: Tensor,
    teacher: TeacherOutputs,
    mask_BT: Tensor,
    *,
    vocab_size: int,
    config: KDTopKConfig,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
) -> LossOutput:
    """Top-k + tail KD at the positions where ``mask_BT`` is True (docs/losses.md, "`kd_topk`")."""
    b, t, width = student_logits_BTV.shape
    if config.support == "teacher":
        teacher.require(("topk_ids", "topk_logprobs", "tail_logprob"), mode="kd_topk")
        ids, lp, rest = teacher.topk_ids, teacher.topk_logprobs, teacher.tail_logprob
    else:
        teacher.require(("col_ids", "col_logprobs", "col_rest_logprob"), mode="kd_topk")
        ids, lp, rest = teacher.col_ids, teacher.col_logprobs, teacher.col_rest_logprob
    if ids.shape[:2] != (b, t) or tuple(mask_BT.shape) != (b, t):
        raise ValueError(
            f"kd_topk: student is {(b, t)}, teacher {tuple(ids.shape[:2])}, mask {tuple(mask_BT.shape)}"
        )
    if bool((ids >= vocab_size).any()):
        raise ValueError(
            f"kd_topk: a teacher id is >= student vocab_size {vocab_size} (same tokenizer?)"
        )
    k = ids.shape[-1]
    rows = mask_BT.reshape(-1).nonzero().squeeze(1)
    logits = student_logits_BTV.reshape(b * t, width)
    count = as_count(rows.numel(), logits.device)
    if rows.numel() == 0:
        return empty_loss(logits, {})
    ids_G = ids.reshape(-1, k)[rows].long()
    logp_G = torch.cat([lp.reshape(-1, k)[rows].float(), rest.reshape(-1, 1)[rows].float()], -1)
    logp_G = logp_G.masked_fill(
        torch.cat([ids_G < 0, ids_G.new_zeros(ids_G.shape[0], 1, dtype=torch.bool)], -1),
        float("-inf"),
    )
    if tp_group is None:
        lp, rest, _ = logprobs_at_rows(
            logits,
            rows,
            ids_G,
            vocab_size=vocab_size,
            temperature=config.temperature,
            chunk_size=chunk_size,
        )
        terms, q_tail = divergence_terms(logp_G, torch.cat([lp, rest[:, None]], -1), config)
    else:
        fn = partial(_kd_block, config=config, vocab_size=vocab_size, tp_group=tp_group)
        terms, q_tail = map_rows(fn, logits, rows, ids_G, logp_G, chunk_size=chunk_size)
    total = terms.sum()
    metrics = {
        "kd_sum": total.detach(),
        "teacher_tail_mass_sum": logp_G[:, -1].exp().sum(),
        "student_tail_mass_sum": q_tail.sum(),
    }
    return LossOutput(total, count, metrics)
