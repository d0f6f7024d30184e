"""The teacher program: what a teacher computes for the loss, in a worker or in-process.

One compute path for the trainer, the tests and the benchmarks. ``TeacherModelProgram`` builds a
configured teacher (pretrained, or tiny random like the student; frozen), optionally tensor-
parallel over the teachers' own process group, and turns its logits into the loss mode's
teacher outputs (`trainer.losses.teacher_outputs`): never full-vocabulary fp32 logits, only what
the loss reads (top-k + tail, columns, the realised next token's log-prob). ``teacher_forward``
is that computation on a model already loaded, applying the lm_head a chunk of positions at a
time, so [B, U, V_teacher] fp32 logits never exist at once (262,144 columns for Gemma).

Under tensor parallelism (``tp > 1``, over the teachers' own process group) the lm_head is
column-parallel too (`parallel.apply_tp`): each teacher rank holds [B, chunk, V_teacher / tp]
logits, and the outputs are computed on that shard with the TP group (`teacher_outputs_from_
logits(tp_group=)`): top-k over the sharded vocabulary (local top-k, candidates gathered),
logZ by a distributed logsumexp, projected / exact-map columns gathered at their global ids,
tail and rest masses as distributed logsumexps. What every TP rank then holds, and ships, is
the same small per-position record as at tp = 1; the full teacher logits are never gathered.

Layouts: the teacher ranks of a TP group may serve student ranks with different microbatches
(another dp or cp layout than the student's): each call gathers the group's inputs, runs them
all, and keeps its own rows, so the student receives its rows whatever the two layouts. A
teacher runs whole rows; the student ranks that hold the same microbatch (cp x tp) give their
teachers a share of its rows each and gather the outputs (`trainer.teacher.feed`), and a
context-parallel student takes its own positions of them (`TeacherOutputs.cp_shard`, for the
per-position modes).

The program is a ``TeacherProgram`` (`trainer.teacher.worker`): picklable and light until
``setup``, which loads the model where the program runs.

Legend: B rows, U teacher positions, V teacher lm_head width, H hidden size, N columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer import models, parallel
from trainer.config import TeacherConfig
from trainer.distributed import build_mesh
from trainer.distributed.dtensor import unwrap_vocab_sharded
from trainer.losses.segments import shift_targets
from trainer.losses.teacher_outputs import (
    TeacherOutputs,
    TeacherOutputSpec,
    allocate_teacher_outputs,
    teacher_output_fields,
    teacher_outputs_from_logits,
)
from trainer.teacher.ring import TensorSpec
from trainer.teacher.worker import TeacherContext


@dataclass
class TeacherModelProgram:
    """A configured teacher as a channel program (picklable; the model is built in `setup`).

    ``columns``: the global column ids [N] the spec asks for (the exact-map teacher ids of
    `gold`), or None. ``max_batch`` / ``max_len`` bound a microbatch and size the ring.

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
    _model: Any = dataclasses.field(default=None, init=False, repr=False)
    _tp_group: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # refused here, in the student, rather than in the worker at the first microbatch
        if self.spec.per_position_columns:
            raise ValueError("TeacherModelProgram: per-position columns need column ids as input")
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
        return spec

    def output_spec(self) -> dict[str, TensorSpec]:
        fields = teacher_output_fields(self.spec, self.max_batch, self.max_len)
        return {k: TensorSpec(shape, dtype) for k, (shape, dtype) in fields.items()}

    def setup(self, ctx: TeacherContext) -> None:
        model = models.freeze(
            models.build_model(
                self.model_cfg, dtype=models.torch_dtype(self.dtype), device=ctx.device
            )
        )
        tp = self.model_cfg.tp
        if tp > 1:
            if not dist.is_initialized():
                raise RuntimeError(f"teacher {self.model_cfg.name}: tp={tp} needs a process group")
            world = dist.get_world_size()
            groups = build_mesh(ctx.device, dp=world // tp, tp=tp)
            parallel.apply_tp(model, groups.tp_mesh, parallel.tp_plan(model.config.model_type))
            self._tp_group = groups.tp
        self._model = model

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
        B, U = ids_BU.shape
        start = 0
        if self._tp_group is not None:
            given = [ids_BU, mask_BU] + ([] if used_BU is None else [used_BU.to(torch.uint8)])
            gathered, start = self._gather(*given)
            ids_BU, mask_BU = gathered[:2]
            used_BU = None if used_BU is None else gathered[2].bool()
        outs = teacher_forward(
            self._model,
            ids_BU,
            mask_BU,
            spec=self.spec,
            columns=self.columns,
            chunk=self.lm_head_chunk,
            used_BU=used_BU,
            on_logits=on_logits,
        )
        return {k: v[start : start + B, :U] for k, v in outs.tensors().items()}


def _whole_vocab(tp_group) -> None:
    if tp_group is not None:
        raise ValueError(
            "teacher_forward: on_logits reads whole-vocabulary logits, but this teacher's "
            "lm_head is vocab-sharded (tp > 1); run it at tp=1"
        )


def teacher_forward(
    model,
    ids_BU: torch.Tensor,
    mask_BU: torch.Tensor,
    *,
    spec: TeacherOutputSpec,
    columns,
    chunk: int,
    used_BU: torch.Tensor | None = None,
    on_logits=None,
) -> TeacherOutputs:
    """The spec's teacher outputs for one microbatch, applying the lm_head `chunk` positions at
    a time (HF causal LMs with ``.model`` + ``.lm_head``; others get full logits). A vocab-
    sharded lm_head (TP) gives DTensor logits: the outputs are computed on the local shard.

    ``used_BU`` (bool [B, U]): only those positions get outputs: the model body still runs over
    every token (each position's context), but the lm_head (for Gemma 170M of its 270M
    parameters, 262,144 columns) and the output reductions run on the used rows only, gathered.
    The other positions are filled NaN (ids -1), so a loss that read one would fail loudly.
    ``on_logits``: called as ``on_logits(t0, logits)`` with each chunk's (softcapped) logits
    [B, n, V] (the teacher cache samples ids from them; whole vocabulary: refused under TP);
    not with ``used_BU``.
    """
    if on_logits is not None and used_BU is not None:
        raise ValueError("teacher_forward: on_logits sees every position; it takes no used_BU")
    len_B = mask_BU.sum(1)
    tgt_BU = shift_targets(ids_BU, len_B) if spec.target else None
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if base is None or head is None:
        out = model(input_ids=ids_BU, attention_mask=mask_BU, use_cache=False).logits
        logits, tp_group = unwrap_vocab_sharded(out)
        if on_logits is not None:
            _whole_vocab(tp_group)
            on_logits(0, logits)
        out = teacher_outputs_from_logits(
            logits, spec=spec, target_ids_BT=tgt_BU, columns=columns, tp_group=tp_group
        )
        return out if used_BU is None else _blank_unused(out, used_BU)
    hidden_BUH = base(input_ids=ids_BU, attention_mask=mask_BU, use_cache=False).last_hidden_state
    # Gemma caps its logits (tanh); the HF model does it after its lm_head, so we do too
    softcap = getattr(model.config, "final_logit_softcapping", None)

    def logits_of(h):
        """(logits, tp group): this rank's vocabulary shard under TP, softcapped."""
        logits, group = unwrap_vocab_sharded(head(h))
        return (torch.tanh(logits / softcap) * softcap if softcap else logits), group

    if used_BU is not None and not bool(used_BU.all()):
        return _used_rows_only(
            hidden_BUH, tgt_BU, used_BU, logits_of, spec=spec, columns=columns, chunk=chunk
        )
    out = allocate_teacher_outputs(spec, *ids_BU.shape, device=ids_BU.device)
    U = ids_BU.shape[1]
    for t0 in range(0, U, chunk):
        n = min(chunk, U - t0)
        logits, tp_group = logits_of(hidden_BUH[:, t0 : t0 + n])
        if on_logits is not None:
            _whole_vocab(tp_group)
            on_logits(t0, logits)
        teacher_outputs_from_logits(
            logits,
            spec=spec,
            target_ids_BT=None if tgt_BU is None else tgt_BU[:, t0 : t0 + n],
            columns=columns,
            out=out.narrow_t(t0, n),
            tp_group=tp_group,
        )
    return out


def _used_rows_only(hidden_BUH, tgt_BU, used_BU, logits_of, *, spec, columns, chunk):
    """Outputs at the used positions: their hidden states gathered into one row [1, N], the
    lm_head applied `chunk` * B rows at a time, then scattered into the [B, U] outputs."""
    B, U, H = hidden_BUH.shape
    rows = used_BU.reshape(-1).nonzero().squeeze(1)
    flat = allocate_teacher_outputs(spec, 1, rows.numel(), device=hidden_BUH.device)
    h_N = hidden_BUH.reshape(B * U, H)[rows][None]
    t_N = None if tgt_BU is None else tgt_BU.reshape(-1)[rows][None]
    per_position = columns is not None and columns.dim() == 3  # [B, U, N] -> [1, N_used, N]
    c_N = columns.reshape(B * U, -1)[rows][None] if per_position else columns
    step = max(1, chunk * B)
    for r0 in range(0, rows.numel(), step):
        n = min(step, rows.numel() - r0)
        logits, tp_group = logits_of(h_N[:, r0 : r0 + n])
        teacher_outputs_from_logits(
            logits,
            spec=spec,
            target_ids_BT=None if t_N is None else t_N[:, r0 : r0 + n],
            columns=c_N[:, r0 : r0 + n] if per_position else c_N,
            out=flat.narrow_t(r0, n),
            tp_group=tp_group,
        )
    out = allocate_teacher_outputs(spec, B, U, device=hidden_BUH.device)
    for name, dst in out.tensors().items():
        dst.fill_(float("nan") if dst.is_floating_point() else -1)
        dst.view(B * U, *dst.shape[2:])[rows] = getattr(flat, name)[0]
    return out


def _blank_unused(out: TeacherOutputs, used_BU: torch.Tensor) -> TeacherOutputs:
    """NaN (ids -1) at the positions no loss reads."""
    for dst in out.tensors().values():
        dst[~used_BU] = float("nan") if dst.is_floating_point() else -1
    return out
