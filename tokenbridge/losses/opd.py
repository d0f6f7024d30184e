"""On-policy distillation losses: the student's own samples, scored by the teacher.

`opd_topk` differentiates a divergence over the student's top-k + tail (`kd_topk` on columns);
`opd_pg` is a policy gradient with the sampled reverse KL per chunk as a negative advantage
(any tokenizers, no projection); `mix_teacher_outputs` mixes same-tokenizer teachers in
probability space. Estimators and their bias: docs/onpolicy.md, "Losses".

Legend: B rollouts, S student positions, V student lm_head width, G chunks, K support.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tokenbridge.losses.alm import chunk_chains
from tokenbridge.losses.base import LossOutput, as_count, check_divergence, check_option, empty_loss
from tokenbridge.losses.kd_topk import KDTopKConfig, kd_topk
from tokenbridge.losses.ops.cp_chunks import open_chunk_loss
from tokenbridge.losses.ops.segments import ChunkIndex
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec


@dataclass(frozen=True)
class OPDTopKConfig:
    """Top-k OPD: the student's top-k support (its sampling policy's) plus a tail bucket."""

    k: int = 16
    divergence: str = "reverse"  # reverse (on-policy default) | forward | jsd
    beta: float = 0.5  # jsd only
    temperature: float = 1.0

    def __post_init__(self) -> None:
        check_divergence(self)
        check_option(self, "k", self.k >= 1, ">= 1")
        check_option(self, "temperature", self.temperature > 0, "> 0")

    def kd_topk(self) -> KDTopKConfig:
        return KDTopKConfig(
            k=self.k,
            divergence=self.divergence,
            beta=self.beta,
            temperature=self.temperature,
            support="columns",
        )


def opd_topk_teacher_spec(config: OPDTopKConfig, *, teacher_vocab_size: int) -> TeacherOutputSpec:
    return TeacherOutputSpec(
        teacher_vocab_size,
        columns=config.k,
        per_position_columns=True,
        temperature=config.temperature,
    )


def opd_topk(
    student_logits_BSV: Tensor,
    teacher: TeacherOutputs,
    mask_BS: Tensor,
    *,
    vocab_size: int,
    config: OPDTopKConfig,
) -> LossOutput:
    """D(P || Q) over the student's top-k + tail at the masked positions (`kd_topk`). The tail
    bucket is what keeps it a divergence: the truncated top-k reverse KL alone clamps to zero in
    most steps."""
    return kd_topk(
        student_logits_BSV, teacher, mask_BS, vocab_size=vocab_size, config=config.kd_topk()
    )


@dataclass(frozen=True)
class OPDPGConfig:
    """Sampled reverse KL as a negative advantage (docs/onpolicy.md, "Losses")."""

    advantage_clip: float = 0.0  # > 0: clip |A_c| (a guard against rare huge log-ratios)

    def __post_init__(self) -> None:
        check_option(self, "advantage_clip", self.advantage_clip >= 0, ">= 0")


def opd_pg_teacher_spec(config: OPDPGConfig, *, teacher_vocab_size: int) -> TeacherOutputSpec:
    return TeacherOutputSpec(teacher_vocab_size, target=True)


def opd_pg(
    student_logits_BSV: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    *,
    vocab_size: int,
    config: OPDPGConfig,
) -> LossOutput:
    """Policy-gradient reverse KL over the completion chunks of ``index``."""
    logits, chunks, metrics = open_chunk_loss(
        "opd_pg", student_logits_BSV, teacher, index, None, fields=("target_logprob",)
    )
    if chunks.numel() == 0:
        return empty_loss(logits, metrics)
    ls, lt = chunk_chains(logits, teacher, index, chunks_C=chunks, vocab_size=vocab_size)
    # REINFORCE per chunk, no credit from later chunks: E_q[(log q - log p) grad log q] is
    # grad KL(q || p) at a position (the score function has mean zero)
    log_ratio = (ls - lt).detach()  # the per-chunk sample of KL(q || p)
    advantage = -log_ratio
    if config.advantage_clip > 0:
        advantage = advantage.clamp(-config.advantage_clip, config.advantage_clip)
    surrogate = -(advantage * ls)
    # value: the k1 estimate of the reverse KL; gradient: the surrogate's
    terms = surrogate + (log_ratio - surrogate).detach()
    total = terms.sum()
    metrics.update(
        {
            "kd_sum": total.detach(),
            "teacher_chain_logprob_sum": lt.detach().sum(),
            "student_chain_logprob_sum": ls.detach().sum(),
        }
    )
    return LossOutput(total, as_count(chunks.numel(), logits.device), metrics)


def mix_teacher_outputs(outs: list[TeacherOutputs], weights: list[float]) -> TeacherOutputs:
    """One target from same-tokenizer teachers, mixed in probability space with ``weights``
    (normalised): log sum_i w_i p_i per column, per rest bucket and per realised token. Every
    teacher must have scored the same column ids (the student's top-k)."""
    if not outs:
        raise ValueError("mix_teacher_outputs: no teacher outputs")
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(
            f"mix_teacher_outputs: weights must be >= 0 with a positive sum: {weights}"
        )
    first = outs[0]
    if first.col_ids is not None and any(not torch.equal(o.col_ids, first.col_ids) for o in outs):
        raise ValueError("mix_teacher_outputs: the teachers scored different column ids")
    fields = {}
    for name in ("col_logprobs", "col_rest_logprob", "target_logprob"):
        parts = [getattr(o, name) for o in outs]
        if any(p is None for p in parts):
            continue
        logw = [math.log(w / total) if w > 0 else float("-inf") for w in weights]
        stacked = torch.stack([p.float() + lw for p, lw in zip(parts, logw)])
        fields[name] = torch.logsumexp(stacked, dim=0)
    if first.col_ids is not None:
        fields["col_ids"] = first.col_ids
    return TeacherOutputs(**fields)
