"""The teacher program: what a teacher computes for the loss, in a worker or in-process.

`TeacherModelProgram` builds a configured teacher (pretrained or tiny random, frozen, tensor-
parallel over the teachers' own process group when its tp > 1) and turns its logits into only
what the loss reads (`tokenbridge.teacher.forward.teacher_forward`), never full-vocabulary
logits: one compute path for the trainer, the tests and the benchmarks, off-policy and on-policy
alike (docs/parallelism.md, "Teachers and their layouts").

Legend: B rows, U teacher positions, V teacher lm_head width, N columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenbridge.teacher.forward import teacher_forward
from tokenbridge.teacher.outputs import (
    TeacherOutputSpec,
    teacher_output_fields,
)
from trainer.config.schema import TeacherConfig
from trainer.parallel.mesh import build_mesh
from trainer.parallel.sharded_build import build_teacher
from trainer.teacher.ring import TensorSpec
from trainer.teacher.worker import TeacherContext


@dataclass
class TeacherModelProgram:
    """A configured teacher as a channel program (picklable; the model is built in `setup`).

    ``columns``: the global column ids [N] the spec asks for (the exact-map teacher ids of
    `gold`), or None; a spec with per-position columns takes them as an input instead
    (``col_ids`` [B, U, N] int32, -1 = none): on-policy top-k asks for the teacher's log-probs
    at the student's own top-k ids, which differ per position and per step, so they travel in
    the slot rather than being fixed when the worker starts. ``max_batch`` / ``max_len`` bound
    a microbatch and size the ring.

    Tensor parallel (``model_cfg.tp > 1``): the teachers of a TP group may serve student ranks
    with different microbatches, so each call all-gathers the group's inputs (padded to a common
    length), runs the sharded model on all of them, and keeps its own rows.

    ``used_mask``: the inputs then carry a bool [B, U] ``used_mask`` (the trainer's
    `KDTerm.teacher_inputs`) and outputs are computed at those positions only (`teacher_forward`).
    """

    model_cfg: TeacherConfig
    spec: TeacherOutputSpec
    _: KW_ONLY
    columns: torch.Tensor | None = None
    max_batch: int
    max_len: int
    dtype: str = "float32"
    lm_head_chunk: int = 128
    used_mask: bool = False
    packed: bool = False  # packed rows: the inputs carry position ids restarting per document
    _model: Any = dataclasses.field(default=None, init=False, repr=False)
    _tp_group: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # refused here, in the student, rather than in the worker at the first microbatch
        if self.spec.per_position_columns:
            if self.columns is not None:
                raise ValueError("TeacherModelProgram: per-position columns come as inputs")
            if self.model_cfg.tp != 1:
                raise ValueError(
                    f"teacher {self.model_cfg.name}: per-position columns (on-policy top-k) "
                    f"run on tp=1 teachers (tp={self.model_cfg.tp})"
                )
            return
        n = 0 if self.columns is None else self.columns.numel()
        if n != self.spec.columns:
            raise ValueError(
                f"TeacherModelProgram: the spec asks for {self.spec.columns} columns, "
                f"{n} column ids given; give that many ids"
            )

    def input_spec(self) -> dict[str, TensorSpec]:
        shape = (self.max_batch, self.max_len)
        spec = {
            "input_ids": TensorSpec(shape, torch.int64),
            "attention_mask": TensorSpec(shape, torch.int64),
        }
        if self.used_mask:
            spec["used_mask"] = TensorSpec(shape, torch.bool)
        if self.packed:
            spec["position_ids"] = TensorSpec(shape, torch.int64)
        if self.spec.per_position_columns:
            spec["col_ids"] = TensorSpec((*shape, self.spec.columns), torch.int32)
        return spec

    def output_spec(self) -> dict[str, TensorSpec]:
        fields = teacher_output_fields(self.spec, self.max_batch, self.max_len)
        return {k: TensorSpec(shape, dtype) for k, (shape, dtype) in fields.items()}

    def setup(self, ctx: TeacherContext) -> None:
        # built on the meta device, TP-sharded there, then each rank reads only its shards
        # (`trainer.parallel.sharded_build.build_teacher`)
        tp = self.model_cfg.tp
        tp_mesh = None
        if tp > 1:
            if not dist.is_initialized():
                raise RuntimeError(f"teacher {self.model_cfg.name}: tp={tp} needs a process group")
            world = dist.get_world_size()
            groups = build_mesh(ctx.device, dp=world // tp, tp=tp)
            tp_mesh, self._tp_group = groups.tp_mesh, groups.tp
        self._model = build_teacher(
            self.model_cfg, dtype=self.dtype, device=ctx.device, tp_mesh=tp_mesh
        )

    def __getstate__(self) -> dict:
        # only the recipe travels to the worker; the model is built there
        return {**self.__dict__, "_model": None, "_tp_group": None}

    def _gather(self, *tensors_BU: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """The TP group's inputs, each padded to the group's largest [B, U] and concatenated;
        and where this rank's rows start."""
        g = self._tp_group
        n = dist.get_world_size(g)
        ids_BU = tensors_BU[0]
        shape = torch.tensor([ids_BU.shape[0], ids_BU.shape[1]], device=ids_BU.device)
        shapes = [torch.zeros_like(shape) for _ in range(n)]
        dist.all_gather(shapes, shape, group=g)
        B, U = max(int(s[0]) for s in shapes), max(int(s[1]) for s in shapes)
        pad = (0, U - ids_BU.shape[1], 0, B - ids_BU.shape[0])
        out = []
        for t in tensors_BU:
            t = torch.nn.functional.pad(t, pad)
            every = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(every, t, group=g)
            out.append(torch.cat(every))
        return out, dist.get_rank(g) * B

    @torch.no_grad()
    def __call__(
        self, inputs: dict[str, torch.Tensor], *, on_logits=None
    ) -> dict[str, torch.Tensor]:
        """The spec's outputs for one microbatch. ``on_logits(t0, logits_BnV)`` (optional) sees
        each chunk of positions' logits as well (the teacher cache samples ids from them)."""
        if self._model is None:
            raise RuntimeError("TeacherModelProgram called before setup()")
        ids_BU, mask_BU = inputs["input_ids"], inputs["attention_mask"]
        used_BU = inputs.get("used_mask") if self.used_mask else None
        pos_BU = inputs["position_ids"] if self.packed else None
        B, U = ids_BU.shape
        start = 0
        if self._tp_group is not None:
            given = [ids_BU, mask_BU] + ([] if used_BU is None else [used_BU.to(torch.uint8)])
            gathered, start = self._gather(*given, *([] if pos_BU is None else [pos_BU]))
            ids_BU, mask_BU = gathered[:2]
            used_BU = None if used_BU is None else gathered[2].bool()
            # padded rows and columns hold position 0: blocks of their own, never attended
            pos_BU = None if pos_BU is None else gathered[-1]
        outs = teacher_forward(
            self._model,
            ids_BU,
            mask_BU,
            spec=self.spec,
            columns=inputs["col_ids"] if self.spec.per_position_columns else self.columns,
            chunk=self.lm_head_chunk,
            used_BU=used_BU,
            on_logits=on_logits,
            position_ids_BU=pos_BU,
        )
        return {k: v[start : start + B, :U] for k, v in outs.tensors().items()}
