"""Teachers score rollouts in their workers, through the same logit channel as off-policy KD.

`ScoringProgram` is the channel program (`trainer.teacher.worker.TeacherProgram`) of an
on-policy teacher: the teacher model built and frozen in its worker, a forward over the rows it
is handed, and the loss mode's teacher outputs computed a chunk of positions at a time
(`trainer.losses.teacher_outputs`), never full-vocabulary fp32 logits. It differs from the
off-policy `trainer.teacher.program.TeacherModelProgram` in one input: top-k OPD asks for the
teacher's log-probs on the **student's** top-k ids at every position, which differ per position
and per step, so they travel in the slot with the ids (``col_ids`` [B, U, K], -1 = none) instead
of being fixed when the worker starts. Every on-policy spec also carries the teacher's log-prob
of each realised token (``target_logprob``): sampled-token reverse KL and the chain losses read
it, and the held-out eval turns it into the teacher's bits per byte of the student's own text.

`open_scorers` starts one channel per on-policy teacher on this rank (worker process, or
in-process for debugging), with as many slots as a step has microbatches: outputs are copied out
of their slot when received, so a slot is free again before the next submit and the teacher can
score step i + 1 while the student learns on step i (``onpolicy.lag: 1``).

Legend: B rows, U teacher positions, V teacher lm_head width, K per-position columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from trainer import models
from trainer.config import TeacherConfig
from trainer.losses.segments import shift_targets
from trainer.losses.teacher_outputs import (
    TeacherOutputs,
    TeacherOutputSpec,
    allocate_teacher_outputs,
    teacher_output_fields,
    teacher_outputs_from_logits,
)
from trainer.teacher.channel import ChannelConfig, TeacherChannel
from trainer.teacher.ring import TensorSpec
from trainer.teacher.worker import TeacherContext


def scoring_spec(spec: TeacherOutputSpec) -> TeacherOutputSpec:
    """A mode's teacher spec plus the realised token's log-prob (eval and chain losses)."""
    extra = TeacherOutputSpec(spec.vocab_size, target=True, temperature=spec.temperature)
    return spec.union(extra)


@dataclass
class ScoringProgram:
    """An on-policy teacher as a channel program (picklable; the model is built in `setup`)."""

    model_cfg: TeacherConfig
    spec: TeacherOutputSpec
    _: KW_ONLY
    max_batch: int
    max_len: int
    dtype: str = "float32"
    lm_head_chunk: int = 128
    _model: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.spec.columns and not self.spec.per_position_columns:
            raise ValueError("ScoringProgram: column sets are per position (the student's top-k)")
        if self.model_cfg.tp != 1:
            raise ValueError(
                f"teacher {self.model_cfg.name}: on-policy scoring runs tp=1 teachers "
                f"(tp={self.model_cfg.tp})"
            )

    def input_spec(self) -> dict[str, TensorSpec]:
        shape = (self.max_batch, self.max_len)
        spec = {
            "input_ids": TensorSpec(shape, torch.int64),
            "attention_mask": TensorSpec(shape, torch.int64),
        }
        if self.spec.per_position_columns:
            spec["col_ids"] = TensorSpec((*shape, self.spec.columns), torch.int32)
        return spec

    def output_spec(self) -> dict[str, TensorSpec]:
        fields = teacher_output_fields(self.spec, self.max_batch, self.max_len)
        return {k: TensorSpec(shape, dtype) for k, (shape, dtype) in fields.items()}

    def setup(self, ctx: TeacherContext) -> None:
        dtype = models.torch_dtype(self.dtype)
        model = models.build_model(self.model_cfg, dtype=dtype, device=ctx.device)
        self._model = models.freeze(model)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None}  # only the recipe travels to the worker

    @torch.no_grad()
    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._model is None:
            raise RuntimeError("ScoringProgram called before setup()")
        out = score_forward(
            self._model,
            inputs["input_ids"],
            inputs["attention_mask"],
            spec=self.spec,
            col_ids_BUK=inputs.get("col_ids"),
            chunk=self.lm_head_chunk,
        )
        return out.tensors()


def score_forward(
    model,
    ids_BU: torch.Tensor,
    mask_BU: torch.Tensor,
    *,
    spec: TeacherOutputSpec,
    col_ids_BUK: torch.Tensor | None,
    chunk: int,
) -> TeacherOutputs:
    """The spec's outputs for one microbatch; the lm_head is applied ``chunk`` positions at a
    time (a [B, U, V] fp32 logits tensor never exists: Gemma's V is 262,144)."""
    targets_BU = shift_targets(ids_BU, mask_BU.sum(1)) if spec.target else None
    hidden_BUH = model.model(
        input_ids=ids_BU, attention_mask=mask_BU, use_cache=False
    ).last_hidden_state
    softcap = getattr(model.config, "final_logit_softcapping", None)  # Gemma's tanh cap
    out = allocate_teacher_outputs(spec, *ids_BU.shape, device=ids_BU.device)
    for t0 in range(0, ids_BU.shape[1], chunk):
        n = min(chunk, ids_BU.shape[1] - t0)
        logits = model.lm_head(hidden_BUH[:, t0 : t0 + n])
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        teacher_outputs_from_logits(
            logits,
            spec=spec,
            target_ids_BT=None if targets_BU is None else targets_BU[:, t0 : t0 + n],
            columns=None if col_ids_BUK is None else col_ids_BUK[:, t0 : t0 + n],
            out=out.narrow_t(t0, n),
        )
    return out


def open_scorers(
    teachers: list[TeacherConfig],
    specs: list[TeacherOutputSpec],
    *,
    device: torch.device,
    max_batch: int,
    max_len: list[int],
    depth: int,
    inprocess: bool,
    timeout_s: float,
    threads: int | None,
) -> list[TeacherChannel]:
    """One started channel per teacher (closed again if any fails to start)."""
    channels: list[TeacherChannel] = []
    try:
        for t_cfg, spec, length in zip(teachers, specs, max_len):
            program = ScoringProgram(
                t_cfg, spec, max_batch=max_batch, max_len=length, dtype=t_cfg.dtype
            )
            cfg = ChannelConfig(
                mode="inprocess" if inprocess else "process",
                depth=depth,
                timeout_s=timeout_s,
                worker_threads=threads,
            )
            channels.append(TeacherChannel(program, device=device, config=cfg))
        for ch in channels:
            ch.wait_ready()
    except BaseException:
        for ch in channels:
            ch.close()
        raise
    return channels


def receive_copy(channel: TeacherChannel) -> tuple[TeacherOutputs, float]:
    """The oldest submitted microbatch's outputs, copied out of the ring (the slot is released
    at once) and the teacher's seconds on it."""
    with channel.receive() as got:
        outs = TeacherOutputs(**{k: v.clone() for k, v in got.outputs.items()})
        return outs, got.teacher_s
