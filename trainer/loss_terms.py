"""The per-teacher distillation terms and their combination with the student's CE.

`tokenbridge.losses` holds the math and the loss-mode registry; `trainer.teacher` runs the
teachers. This module joins the two for the step: a `KDTerm` per teacher, and the one place
that says which teacher positions a term reads (`used_inputs`, for shard rows and rollouts
alike). Terms are computed on this rank's positions (CP) and vocabulary shard (TP).

Legend: B rows, T student positions, L of them on this CP rank, V student vocabulary (lm_head
width; its local shard under TP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenbridge.losses.base import LossOutput
from tokenbridge.losses.ce import ce
from tokenbridge.losses.combine import CombineConfig, combine
from tokenbridge.losses.modes import MODES, LossMode
from tokenbridge.losses.multi_teacher import MultiTeacherConfig, combine_teachers, teacher_weights
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec
from trainer.config.schema import TrainConfig
from trainer.data.microbatches import Microbatch

if TYPE_CHECKING:
    from tokenbridge.dist_ops import CPContext


@dataclass
class KDTerm:
    """One teacher's distillation term: its loss mode and options, projection tables and the
    teacher-output spec that mode needs (never more), and the calls the step makes per
    microbatch: ``prepare`` (from the batch alone), ``count`` (known before any forward, so the
    step's global count is all-reduced before the first backward), ``teacher_inputs`` and
    ``loss``."""

    index: int
    name: str
    mode: str
    options: Any  # the mode's options dataclass (KDTopKConfig, XTokenConfig, ...)
    spec: TeacherOutputSpec
    tables: Any  # XTokenTables | GoldTables | None, on the student's device
    vocab_size: int  # the student tokenizer's size: lm_head columns past it are masked
    weight: float = 1.0  # ``teachers[i].weight`` (normalised over the terms: `kd_weights`)

    @property
    def record(self) -> LossMode:
        return MODES[self.mode]

    def columns(self) -> torch.Tensor | None:
        """The column ids the teacher must score (CPU), or None."""
        return self.record.columns(self.tables)

    def prepare(self, mb: Microbatch) -> Any:
        try:
            return self.record.prepare(mb.aligned[self.index], mb.targets_BT)
        except ValueError as e:
            raise ValueError(f"teacher {self.name}, rows {mb.rows}: {e}") from None

    def count(self, prep: Any, cp: CPContext | None = None) -> int:
        """The terms this rank's `loss` will count (its CP share; TP ranks count alike)."""
        return self.record.count(prep, cp)

    def teacher_inputs(self, mb: Microbatch, prep: Any) -> dict[str, torch.Tensor]:
        """What the teacher reads for this term on a shard microbatch (`used_inputs`)."""
        return used_inputs(self.record, prep, mb.teacher_inputs(self.index))

    def loss(
        self,
        logits_BLV: torch.Tensor,
        outs: TeacherOutputs,
        prep: Any,
        *,
        tp_group=None,
        cp: CPContext | None = None,
    ) -> LossOutput:
        """``logits_BLV``: this rank's positions and vocabulary shard (``tp_group``), the
        teacher's outputs and ``prep`` over whole rows (`tokenbridge.losses.modes`)."""
        return self.record.loss(
            logits_BLV,
            outs,
            prep,
            tables=self.tables,
            vocab_size=self.vocab_size,
            config=self.options,
            tp_group=tp_group,
            cp=cp,
        )


def used_inputs(
    record: Any, prep: Any, inputs: dict, *, completion: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """A teacher's ``inputs`` (its ids and attention mask [B, U]) with ``used_mask`` [B, U]:
    the positions whose outputs the loss of mode ``record`` (a `MODES` entry) reads, given its
    ``prep``; the teacher computes outputs there only (`teacher_forward`). On shard rows, the
    rows the mode names where it names them (on conversations, the trained chunks'), else every
    real position. On rollouts (``completion``: the positions that predict a completion token,
    `trainer.onpolicy.rollouts.completion_rows`), those and the rows the mode names, real
    positions only: the prompt is never a target and carries no chunk."""
    width = inputs["input_ids"].shape[1]
    rows = record.teacher_rows
    if completion is None:
        used = rows(prep, width) if rows is not None else inputs["attention_mask"] > 0
    else:
        used = completion if rows is None else completion | rows(prep, width).bool()
        used = used & (inputs["attention_mask"] > 0)
    return {**inputs, "used_mask": used.to(torch.bool)}


def build_kd_terms(cfg: TrainConfig, prepared, *, device: torch.device) -> list[KDTerm]:
    """One `KDTerm` per teacher with a non-zero weight (none for loss.mode=ce)."""
    if not cfg.kd_enabled:
        return []
    vocab = prepared.student_tok.vocab_size
    terms = []
    for i, (t_cfg, mode) in enumerate(zip(cfg.teachers, cfg.teacher_modes())):
        if t_cfg.weight == 0:
            continue
        record = MODES[mode]
        options = cfg.loss.mode_options(mode)
        t_vocab = prepared.teacher_toks[i].vocab_size
        tables = None
        if record.tables is not None:
            tables = record.tables(
                prepared.projections[i], teacher_vocab_size=t_vocab, student_vocab_size=vocab
            )
        spec = record.teacher_spec(options, tables, teacher_vocab_size=t_vocab)
        spec = record.spec_for(spec, turns=prepared.shards.meta.is_chat)
        tables = tables.to(device) if tables is not None else None
        terms.append(KDTerm(i, t_cfg.name, mode, options, spec, tables, vocab, t_cfg.weight))
    return terms


def ce_term(
    logits_BLV: torch.Tensor,
    mb: Microbatch,
    *,
    vocab_size: int,
    tp_group=None,
    cp: CPContext | None = None,
) -> LossOutput:
    """The student's CE on this rank's positions (``cp``) and vocabulary shard (``tp_group``)."""
    # targets are IGNORE at untrained positions (conversations: `trainer.data.microbatches.train_targets`)
    targets = mb.targets_BT if cp is None else cp.shard(mb.targets_BT)
    return ce(logits_BLV, targets, vocab_size=vocab_size, tp_group=tp_group)


def combine_terms(
    config: CombineConfig,
    ce: torch.Tensor,
    kd: list[torch.Tensor],
    *,
    weights: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """The loss to backward from the normalised CE and KD terms (each its local sum over its
    global count): CE alone without KD terms, else the teachers' ``weights``-ed KD sum combined
    with CE (`tokenbridge.losses.combine`; ``config``: ``LossConfig.combine_config()``, built
    once per run; ``scale``: the dynamic mode's |CE| / |KD|)."""
    if not kd:
        return config.ce_weight * ce
    kd_v, _ = combine_teachers(kd, weights.to(ce.device))
    total, _ = combine(kd_v, ce, config=config, scale=scale)
    return total


def kd_weights(terms: list[KDTerm]) -> torch.Tensor:
    """The terms' ``teachers[i].weight``, normalised to sum to 1 (float64, CPU)."""
    return teacher_weights(MultiTeacherConfig(weights=tuple(t.weight for t in terms)), len(terms))
