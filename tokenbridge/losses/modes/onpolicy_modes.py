"""The on-policy modes: they read the student's own samples (`trainer.onpolicy`), scored by the
teacher (`tokenbridge.losses.opd`), so they are ``onpolicy.loss`` modes, never ``loss.mode``.

Both take whole logits on whole rows: the on-policy step gathers them
(`trainer.onpolicy.rollout_source`), and their loss functions have no TP or CP layout.

Legend: B rows, T student positions, V student vocabulary (whole rows, whole lm_head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from tokenbridge.losses.base import LossOutput
from tokenbridge.losses.modes.chunk_modes import chunk_count
from tokenbridge.losses.modes.loss_mode import LossMode
from tokenbridge.losses.modes.position_modes import PositionMode
from tokenbridge.losses.opd import (
    OPDPGConfig,
    OPDTopKConfig,
    opd_pg,
    opd_pg_teacher_spec,
    opd_topk,
    opd_topk_teacher_spec,
)
from tokenbridge.losses.ops.segments import AlignedBatch, ChunkIndex, index_chunks
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec

if TYPE_CHECKING:  # tokenbridge.dist_ops is imported lazily (see vocab_ops)
    from tokenbridge.dist_ops import CPContext


def _whole_rows(mode: str, tp_group, cp) -> None:
    # the loss functions compute over whole logits: a shard would give wrong numbers silently
    if tp_group is not None or cp is not None:
        raise ValueError(f"{mode} takes whole logits on whole rows, not a TP/CP shard")


class OPDTopK(PositionMode):
    """The student's top-k + tail against the teacher's scores of them (same tokenizer); the
    teacher reads every real position of a rollout (``teacher_rows`` None)."""

    name = "opd_topk"
    options = OPDTopKConfig
    onpolicy_only = True

    def teacher_spec(
        self, options: OPDTopKConfig, tables: None, *, teacher_vocab_size: int
    ) -> TeacherOutputSpec:
        return opd_topk_teacher_spec(options, teacher_vocab_size=teacher_vocab_size)

    def loss(
        self,
        logits_BTV: Tensor,
        outs: TeacherOutputs,
        mask_BT: Tensor,
        *,
        tables: None,
        vocab_size: int,
        config: OPDTopKConfig,
        tp_group=None,
        cp: CPContext | None = None,
    ) -> LossOutput:
        _whole_rows(self.name, tp_group, cp)
        outs = outs.narrow_t(0, logits_BTV.shape[1])
        return opd_topk(logits_BTV, outs, mask_BT, vocab_size=vocab_size, config=config)


class OPDPG(LossMode):
    """Sampled reverse KL as a negative advantage, per aligned chunk (any tokenizer)."""

    name = "opd_pg"
    options = OPDPGConfig
    onpolicy_only = True

    def teacher_spec(
        self, options: OPDPGConfig, tables: None, *, teacher_vocab_size: int
    ) -> TeacherOutputSpec:
        return opd_pg_teacher_spec(options, teacher_vocab_size=teacher_vocab_size)

    def prepare(self, aligned: AlignedBatch, targets_BT: Tensor) -> ChunkIndex:
        # the rollout rows aligned on the fly (`trainer.onpolicy.realign`); no train mask to apply
        return index_chunks(aligned)

    def count(self, index: ChunkIndex, cp: CPContext | None = None) -> int:
        return chunk_count(index, cp, term_row="start")

    def loss(
        self,
        logits_BTV: Tensor,
        outs: TeacherOutputs,
        index: ChunkIndex,
        *,
        tables: None,
        vocab_size: int,
        config: OPDPGConfig,
        tp_group=None,
        cp: CPContext | None = None,
    ) -> LossOutput:
        _whole_rows(self.name, tp_group, cp)
        return opd_pg(logits_BTV, outs, index, vocab_size=vocab_size, config=config)
