"""The same-tokenizer modes: one term per distilled position, teacher and student aligned 1:1.

`PositionMode` prepares the mask of distilled positions (every position that predicts a token);
`KDTopK` is the off-policy one (`tokenbridge.losses.kd_topk`); `opd_topk` shares the mask
(`onpolicy_modes`).

Legend: B rows, T student positions (whole rows), L of them on this CP rank (T at cp = 1), V
student lm_head width (its local shard under TP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tokenbridge.losses.base import LossOutput
from tokenbridge.losses.kd_topk import KDTopKConfig, kd_topk, kd_topk_teacher_spec
from tokenbridge.losses.modes.loss_mode import LossMode
from tokenbridge.losses.ops.segments import AlignedBatch
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec

if TYPE_CHECKING:  # tokenbridge.dist_ops is imported lazily (see vocab_ops)
    from tokenbridge.dist_ops import CPContext


class PositionMode(LossMode):
    """A mode over the student's own vocabulary whose terms are the distilled positions."""

    same_tokenizer = True

    def prepare(self, aligned: AlignedBatch, targets_BT: Tensor) -> Tensor:
        """The mask [B, T] of distilled positions: every one that predicts a token (targets
        -1: none)."""
        if not torch.equal(aligned.teacher_len, aligned.student_len):
            raise ValueError(
                "kd_topk needs identical tokenizations, the rows have lengths "
                f"{aligned.teacher_len.tolist()} (teacher) vs "
                f"{aligned.student_len.tolist()} (student)"
            )
        return targets_BT >= 0

    def count(self, mask_BT: Tensor, cp: CPContext | None = None) -> int:
        # the distilled positions this CP rank holds
        return int((mask_BT if cp is None else cp.shard(mask_BT)).sum())


class KDTopK(PositionMode):
    """Top-k KD on the same tokenizer: the teacher's top-k and tail against the student's."""

    name = "kd_topk"
    options = KDTopKConfig

    def teacher_spec(
        self, options: KDTopKConfig, tables: None, *, teacher_vocab_size: int
    ) -> TeacherOutputSpec:
        return kd_topk_teacher_spec(options, teacher_vocab_size=teacher_vocab_size)

    def teacher_rows(self, mask_BT: Tensor, width: int) -> Tensor:
        """The teacher reads the distilled positions (its rows may be wider)."""
        rows = mask_BT.new_zeros((mask_BT.shape[0], width))
        n = min(width, mask_BT.shape[1])
        rows[:, :n] = mask_BT[:, :n]
        return rows

    def loss(
        self,
        logits_BLV: Tensor,
        outs: TeacherOutputs,
        mask_BT: Tensor,
        *,
        tables: None,
        vocab_size: int,
        config: KDTopKConfig,
        tp_group=None,
        cp: CPContext | None = None,
    ) -> LossOutput:
        # the teacher's rows may be padded wider than the student's; under CP the student holds
        # its own positions of them (the teacher ran the whole rows)
        outs = outs.narrow_t(0, mask_BT.shape[1])
        if cp is not None:
            outs, mask_BT = outs.cp_shard(cp), cp.shard(mask_BT)
        return kd_topk(
            logits_BLV, outs, mask_BT, vocab_size=vocab_size, config=config, tp_group=tp_group
        )
