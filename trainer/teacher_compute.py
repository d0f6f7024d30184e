"""What a teacher worker computes: ``HFTeacher`` (a program) and its outputs recipe (pure).

A worker never ships full-vocabulary fp32 logits: it reduces them on its side to what the
configured loss reads (top-k + tail, columns, the realised next token's log-prob) and writes
those fields into the channel's slots. The structure and the reduction belong to the loss
library (``trainer.losses.teacher_outputs``); this module only adapts them to the channel: the
fixed maximum shapes that size the ring, and the next-token targets derived from the inputs.

``HFTeacher`` (a ``TeacherProgram``, see trainer.teacher_worker) runs a local HF causal LM on
``input_ids``/``attention_mask`` and hands its full logits to a recipe. It is the minimal program
(tests, benchmarks, debugging); the trainer's configured teacher
(``trainer.distill.TeacherModelProgram``) applies the lm_head in chunks along T instead.

Legend: B = microbatch rows, T = tokens per row, V = teacher lm_head width, N = columns.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class OutputsRecipe(Protocol):
    """Teacher logits -> the named tensors the loss needs (e.g. ``TeacherOutputsRecipe``)."""

    def spec_for(self, *, max_batch: int, max_len: int) -> dict[str, TensorSpec]: ...

    def __call__(
        self, logits_BTV: torch.Tensor, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]: ...


@dataclass
class HFTeacher:
    """A local HF causal LM as a teacher program: inputs ``input_ids``/``attention_mask`` [B, T].

    parallelize: optional ``"module:function"`` called as ``fn(model, ctx) -> model`` after
    loading, to shard the teacher over ``ctx.group`` (its own TP layout).
    """

    model_dir: str
    recipe: OutputsRecipe
    max_batch: int
    max_len: int
    dtype: str = "float32"
    parallelize: str | None = None
    _model: Any = field(default=None, init=False, repr=False)

    def input_spec(self) -> dict[str, TensorSpec]:
        shape = (self.max_batch, self.max_len)
        return {
            "input_ids": TensorSpec(shape, torch.int64),
            "attention_mask": TensorSpec(shape, torch.int64),
        }

    def output_spec(self) -> dict[str, TensorSpec]:
        return self.recipe.spec_for(max_batch=self.max_batch, max_len=self.max_len)

    def setup(self, ctx) -> None:  # ctx: trainer.teacher_worker.TeacherContext
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), dtype=getattr(torch, self.dtype)
        )
        model = model.to(ctx.device).eval().requires_grad_(False)
        if self.parallelize:
            module, _, fn = self.parallelize.partition(":")
            model = getattr(importlib.import_module(module), fn)(model, ctx)
        self._model = model

    @torch.inference_mode()
    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._model is None:
            raise RuntimeError("HFTeacher called before setup()")
        out = self._model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
        )
        return self.recipe(out.logits, inputs)

    def __getstate__(self) -> dict:
        # Only the recipe travels to the worker; the model is loaded there.
        return {**self.__dict__, "_model": None}
