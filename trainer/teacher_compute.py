"""Outputs recipe: teacher logits -> the loss library's ``TeacherOutputs`` fields (pure).

A worker never ships full-vocabulary fp32 logits: it reduces them on its side to what the
configured loss reads (top-k + tail, columns, the realised next token's log-prob) and writes
those fields into the channel's slots. The structure and the reduction belong to the loss
library (``trainer.losses.teacher_outputs``); this module only adapts them to the channel: the
fixed maximum shapes that size the ring, and the next-token targets derived from the inputs.

The trainer's configured teacher (``trainer.distill.TeacherModelProgram``) applies the lm_head in
chunks along T; ``HFTeacher`` + this recipe is the minimal program (tests, benchmarks,
debugging) and takes full logits.

Legend: B = microbatch rows, T = tokens per row, V = teacher lm_head width, N = columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from trainer.channel import TensorSpec
from trainer.losses.segments import shift_targets
from trainer.losses.teacher_outputs import (
    TeacherOutputSpec,
    teacher_output_fields,
    teacher_outputs_from_logits,
)


def ring_spec(spec: TeacherOutputSpec, *, max_batch: int, max_len: int) -> dict[str, TensorSpec]:
    """The channel's output spec for a teacher-output spec at the largest microbatch."""
    fields = teacher_output_fields(spec, max_batch, max_len)
    return {name: TensorSpec(shape, dtype) for name, (shape, dtype) in fields.items()}


@dataclass(frozen=True)
class TeacherOutputsRecipe:
    """What a loss needs from the teacher, as a recipe for ``HFTeacher``.

    columns: the global column set [N] (e.g. exact-map teacher ids for ``gold``), or None.
    Rows are right-padded: the next-token target of a position is -1 past the row's length.
    """

    spec: TeacherOutputSpec
    columns: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.spec.columns and self.spec.per_position_columns:
            raise ValueError("per-position columns are not supported by this recipe")
        if self.spec.columns and (
            self.columns is None or self.columns.numel() != self.spec.columns
        ):
            raise ValueError(f"spec asks for {self.spec.columns} columns; give that many ids")

    def spec_for(self, *, max_batch: int, max_len: int) -> dict[str, TensorSpec]:
        return ring_spec(self.spec, max_batch=max_batch, max_len=max_len)

    def __call__(
        self, logits_BTV: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        ids_BT, mask_BT = inputs["input_ids"], inputs["attention_mask"]
        targets_BT = shift_targets(ids_BT, mask_BT.sum(1)) if self.spec.target else None
        outs = teacher_outputs_from_logits(
            logits_BTV, spec=self.spec, target_ids_BT=targets_BT, columns=self.columns
        )
        return outs.tensors()
