"""The distillation wiring: per-teacher loss terms, the teacher program, and the channels to it.

`trainer.losses` holds the math (pure functions); `trainer.channel` moves tensors between
processes. This module joins them for the loop:

- `KDTerm`: one teacher's term: its loss mode and options, its projection tables, the
  teacher-output spec that mode needs (never more), and three calls the loop makes per
  microbatch: ``prepare`` (chunk index, from the batch alone), ``count`` (known before any
  forward, so the step's global count is all-reduced before the first backward) and ``loss``.
- `TeacherModelProgram`: what a teacher worker runs: builds the teacher (pretrained or tiny
  random, like the student), optionally tensor-parallel over the teachers' own process group,
  and turns its logits into the spec's outputs chunk by chunk along T (the lm_head is applied
  per chunk, so [B, U, V_teacher] fp32 logits never exist at once).
- `open_teachers`: one `TeacherChannel` per teacher on this rank (worker process or in-process).

Legend: B rows, T student positions, U teacher positions, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer import models, parallel
from trainer.channel import ChannelConfig, TeacherChannel, TensorSpec
from trainer.config import ConfigError, LossConfig, TeacherConfig, TrainConfig
from trainer.data import IGNORE, Microbatch
from trainer.losses.alm import AlmConfig, alm, alm_teacher_spec, complete_chunks
from trainer.losses.base import LossOutput
from trainer.losses.ce import ce
from trainer.losses.combine import CombineConfig, combine
from trainer.losses.gold import GoldConfig, GoldTables, gold, gold_teacher_spec
from trainer.losses.kd_topk import KDTopKConfig, kd_topk, kd_topk_teacher_spec
from trainer.losses.multi_teacher import combine_teachers, static_weights
from trainer.losses.segments import index_chunks, shift_targets
from trainer.losses.teacher_outputs import (
    TeacherOutputs,
    TeacherOutputSpec,
    allocate_teacher_outputs,
    teacher_output_fields,
    teacher_outputs_from_logits,
)
from trainer.losses.xtoken import XTokenConfig, XTokenTables, xtoken, xtoken_teacher_spec
from trainer.teacher_worker import TeacherContext, TeacherGroup

_MODE_CONFIGS = {
    "kd_topk": KDTopKConfig,
    "xtoken": XTokenConfig,
    "alm": AlmConfig,
    "gold": GoldConfig,
}


def mode_config(mode: str, loss: LossConfig) -> Any:
    """The loss module's config dataclass for `mode` from ``loss.options`` (+ temperature)."""
    cls = _MODE_CONFIGS[mode]
    names = {f.name for f in dataclasses.fields(cls)}
    opts = dict(loss.options)
    if "temperature" in names and "temperature" not in opts:
        opts["temperature"] = loss.temperature
    unknown = sorted(set(opts) - names)
    if unknown:
        raise ConfigError(f"config loss.options: {mode} takes {sorted(names)}, not {unknown}")
    try:
        return cls(**opts)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config loss.options for {mode}: {e}") from None


@dataclass
class KDTerm:
    """One teacher's distillation term (see the module docstring)."""

    index: int
    name: str
    mode: str
    config: Any  # KDTopKConfig | XTokenConfig | AlmConfig | GoldConfig
    spec: TeacherOutputSpec
    tables: Any  # XTokenTables | GoldTables | None, on the student's device
    vocab_size: int  # the student tokenizer's size: lm_head columns past it are masked

    def columns(self) -> torch.Tensor | None:
        return self.tables.t_ids.cpu() if isinstance(self.tables, GoldTables) else None

    def prepare(self, mb: Microbatch) -> Any:
        a = mb.aligned[self.index]
        if self.mode == "kd_topk":
            if not torch.equal(a.teacher_len, a.student_len):
                raise ValueError(
                    f"teacher {self.name}: kd_topk needs identical tokenizations, rows "
                    f"{mb.rows} have lengths {a.teacher_len.tolist()} vs {a.student_len.tolist()}"
                )
            return mb.targets_BT != IGNORE
        return index_chunks(a)

    def count(self, prep: Any) -> int:
        if self.mode == "kd_topk":
            return int(prep.sum())
        return int(complete_chunks(prep)[0].numel())

    def loss(self, logits_BTV: torch.Tensor, outs: TeacherOutputs, prep: Any) -> LossOutput:
        kw = {"vocab_size": self.vocab_size, "config": self.config}
        if self.mode == "kd_topk":
            # same tokenizer: the teacher's rows may be padded wider than the student's
            outs = outs.narrow_t(0, logits_BTV.shape[1])
            return kd_topk(logits_BTV, outs, prep, **kw)
        if self.mode == "xtoken":
            return xtoken(logits_BTV, outs, prep, tables=self.tables, **kw)
        if self.mode == "gold":
            return gold(logits_BTV, outs, prep, tables=self.tables, **kw)
        return alm(logits_BTV, outs, prep, **kw)


def build_kd_terms(cfg: TrainConfig, prepared, *, device: torch.device) -> list[KDTerm]:
    """One `KDTerm` per teacher with a non-zero weight (none for loss.mode=ce)."""
    if not cfg.kd_enabled:
        return []
    vocab = prepared.student_tok.vocab_size
    terms = []
    for i, (t_cfg, mode) in enumerate(zip(cfg.teachers, cfg.teacher_modes())):
        if t_cfg.weight == 0:
            continue
        mc = mode_config(mode, cfg.loss)
        t_vocab = prepared.teacher_toks[i].vocab_size
        tables = None
        if mode == "kd_topk":
            if getattr(mc, "support", "teacher") != "teacher":
                raise ConfigError(
                    "config loss.options.support: only 'teacher' (the teacher runs ahead)"
                )
            spec = kd_topk_teacher_spec(mc, teacher_vocab_size=t_vocab)
        elif mode == "xtoken":
            tables = XTokenTables.from_projection(prepared.projections[i], student_vocab_size=vocab)
            spec = xtoken_teacher_spec(mc, teacher_vocab_size=t_vocab)
        elif mode == "gold":
            tables = GoldTables.from_projection(
                prepared.projections[i], teacher_vocab_size=t_vocab, student_vocab_size=vocab
            )
            spec = gold_teacher_spec(mc, tables, teacher_vocab_size=t_vocab)
        else:
            spec = alm_teacher_spec(mc, teacher_vocab_size=t_vocab)
        tables = tables.to(device) if tables is not None else None
        terms.append(KDTerm(i, t_cfg.name, mode, mc, spec, tables, vocab))
    return terms


def ce_term(logits_BTV: torch.Tensor, mb: Microbatch, *, vocab_size: int) -> LossOutput:
    return ce(logits_BTV, mb.targets_BT, vocab_size=vocab_size)


def combine_terms(
    loss_cfg: LossConfig,
    ce_out: LossOutput,
    kd_outs: list[LossOutput],
    *,
    counts: torch.Tensor,
    weights: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss to backward, [ce, kd_0..]) with every term divided by its GLOBAL count (`counts`
    = [ce, kd_0, ...] summed over the step and the dp ranks)."""
    ce_v = ce_out.mean(counts[0])
    if not kd_outs:
        return loss_cfg.ce_weight * ce_v, [ce_v.detach()]
    kd_vs = [o.mean(counts[1 + i]) for i, o in enumerate(kd_outs)]
    kd_v, _ = combine_teachers(kd_vs, weights.to(ce_v.device))
    cc = CombineConfig(
        mode=loss_cfg.combine, kd_weight=loss_cfg.kd_weight, ce_weight=loss_cfg.ce_weight
    )
    total, _ = combine(kd_v, ce_v, config=cc, scale=scale)
    return total, [ce_v.detach(), *(v.detach() for v in kd_vs)]


def teacher_weights(cfg: TrainConfig, terms: list[KDTerm]) -> torch.Tensor:
    return static_weights(len(terms), [cfg.teachers[t.index].weight for t in terms])


# -------------------------------------------------------------------------------------------
# the teacher program (runs in the worker process, or in-process for debugging)


@dataclass
class TeacherModelProgram:
    """A configured teacher as a channel program (picklable; the model is built in `setup`).

    Tensor parallel (``model_cfg.tp > 1``): the teachers of a TP group may serve student ranks
    with different microbatches, so each call all-gathers the group's inputs (padded to a common
    length), runs the sharded model on all of them, and keeps its own rows.
    """

    model_cfg: TeacherConfig
    spec: TeacherOutputSpec
    columns: torch.Tensor | None
    max_batch: int
    max_len: int
    dtype: str = "float32"
    lm_head_chunk: int = 128
    _model: Any = dataclasses.field(default=None, init=False, repr=False)
    _tp_group: Any = dataclasses.field(default=None, init=False, repr=False)

    def input_spec(self) -> dict[str, TensorSpec]:
        shape = (self.max_batch, self.max_len)
        return {
            "input_ids": TensorSpec(shape, torch.int64),
            "attention_mask": TensorSpec(shape, torch.int64),
        }

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
            mesh = parallel.build_mesh(ctx.device, dp=world // tp, tp=tp)
            parallel.apply_tp(model, mesh.tp, parallel.tp_plan(model.config.model_type))
            self._tp_group = mesh.tp_group
        self._model = model

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None, "_tp_group": None}

    def _gather(self, ids_BU: torch.Tensor, mask_BU: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = self._tp_group
        n = dist.get_world_size(g)
        shape = torch.tensor([ids_BU.shape[0], ids_BU.shape[1]], device=ids_BU.device)
        shapes = [torch.zeros_like(shape) for _ in range(n)]
        dist.all_gather(shapes, shape, group=g)
        B, U = max(int(s[0]) for s in shapes), max(int(s[1]) for s in shapes)
        pad = (0, U - ids_BU.shape[1], 0, B - ids_BU.shape[0])
        ids, mask = torch.nn.functional.pad(ids_BU, pad), torch.nn.functional.pad(mask_BU, pad)
        all_ids, all_mask = (
            [torch.empty_like(ids) for _ in range(n)],
            [torch.empty_like(mask) for _ in range(n)],
        )
        dist.all_gather(all_ids, ids, group=g)
        dist.all_gather(all_mask, mask, group=g)
        me = dist.get_rank(g)
        return torch.cat(all_ids), torch.cat(all_mask), me * B, B

    @torch.no_grad()
    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids_BU, mask_BU = inputs["input_ids"], inputs["attention_mask"]
        B, U = ids_BU.shape
        start = 0
        if self._tp_group is not None:
            ids_BU, mask_BU, start, _ = self._gather(ids_BU, mask_BU)
        outs = teacher_forward(
            self._model,
            ids_BU,
            mask_BU,
            spec=self.spec,
            columns=self.columns,
            chunk=self.lm_head_chunk,
        )
        return {k: v[start : start + B, :U] for k, v in outs.tensors().items()}


def teacher_forward(
    model,
    ids_BU: torch.Tensor,
    mask_BU: torch.Tensor,
    *,
    spec: TeacherOutputSpec,
    columns,
    chunk: int,
) -> TeacherOutputs:
    """The spec's teacher outputs for one microbatch, applying the lm_head `chunk` positions at
    a time (HF causal LMs with ``.model`` + ``.lm_head``; others get full logits)."""
    len_B = mask_BU.sum(1)
    tgt_BU = shift_targets(ids_BU, len_B) if spec.target else None
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if base is None or head is None:
        logits = model(input_ids=ids_BU, attention_mask=mask_BU, use_cache=False).logits
        return teacher_outputs_from_logits(logits, spec=spec, target_ids_BT=tgt_BU, columns=columns)
    hidden_BUH = base(input_ids=ids_BU, attention_mask=mask_BU, use_cache=False).last_hidden_state
    softcap = getattr(model.config, "final_logit_softcapping", None)
    out = allocate_teacher_outputs(spec, *ids_BU.shape, device=ids_BU.device)
    U = ids_BU.shape[1]
    for t0 in range(0, U, chunk):
        n = min(chunk, U - t0)
        logits = head(hidden_BUH[:, t0 : t0 + n])
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        teacher_outputs_from_logits(
            logits,
            spec=spec,
            target_ids_BT=None if tgt_BU is None else tgt_BU[:, t0 : t0 + n],
            columns=columns,
            out=out.narrow_t(t0, n),
        )
    return out


@dataclass
class Queued:
    """A microbatch waiting in the feed: where the data stream was before it (what a checkpoint
    records while it is unused), its per-term preparation, and whether the teacher has it."""

    position: dict
    mb: Microbatch
    prep: list = dataclasses.field(default_factory=list)
    submitted: bool = False


class Feed:
    """Microbatches from the loader, handed to the teacher channels as soon as a ring slot is free,
    so the teacher computes microbatch i+1 while the student steps on microbatch i (and runs
    across step boundaries too)."""

    def __init__(self, loader, terms: list[KDTerm], channels: list[TeacherChannel], *, device):
        self.loader, self.terms, self.channels, self.device = loader, terms, channels, device
        self.depth = min(ch.config.depth for ch in channels) if channels else 1
        self.queue: deque[Queued] = deque()

    def _fill(self, n: int) -> None:
        while len(self.queue) < max(n, self.depth):
            position = self.loader.state_dict()
            mb = next(self.loader).to(self.device)
            self.queue.append(Queued(position, mb, [t.prepare(mb) for t in self.terms]))
        in_flight = sum(q.submitted for q in self.queue)
        for q in self.queue:
            if not self.channels or in_flight >= self.depth:
                break
            if not q.submitted:
                for term, ch in zip(self.terms, self.channels):
                    ch.submit(q.mb.teacher_inputs(term.index))
                q.submitted, in_flight = True, in_flight + 1

    def peek(self, n: int) -> list[Queued]:
        """The next `n` microbatches (loaded, prepared; counts can be taken before any forward)."""
        self._fill(n)
        return [self.queue[i] for i in range(n)]

    def next(self) -> tuple[Queued, list]:
        """The next microbatch and its teachers' outputs (`Received`: release them after use)."""
        self._fill(1)
        q = self.queue.popleft()
        # with 2 slots the teacher now works on the next microbatch while the caller steps on this
        # one; this slot is free again once the caller releases `received`
        received = [ch.receive() for ch in self.channels]
        return q, received

    def position(self) -> dict:
        """The data position before the first unused microbatch."""
        return self.queue[0].position if self.queue else self.loader.state_dict()

    def reset(self) -> None:
        """Forget queued microbatches (after loading a checkpoint; the teacher is idle then)."""
        if any(q.submitted for q in self.queue):
            raise RuntimeError("cannot reset the feed while the teacher holds microbatches")
        self.queue.clear()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def open_teachers(
    cfg: TrainConfig,
    terms: list[KDTerm],
    *,
    device: torch.device,
    rank: int,
    world: int,
    max_len: list[int],
    threads: int | None,
) -> list[TeacherChannel]:
    """One channel per KD term on this rank: a worker process (or in-process, for debugging)
    that runs the teacher one microbatch ahead. `max_len[i]` bounds teacher i's rows."""
    channels: list[TeacherChannel] = []
    try:
        for term in terms:
            t_cfg = cfg.teachers[term.index]
            program = TeacherModelProgram(
                t_cfg,
                term.spec,
                term.columns(),
                max_batch=cfg.data.micro_batch_size,
                max_len=max_len[term.index],
                dtype=t_cfg.dtype,
            )
            inprocess = cfg.parallel.teacher_placement == "inprocess"
            group = None
            if not inprocess and t_cfg.tp > 1:
                box = [f"tcp://{_master_addr()}:{_free_port()}" if rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
                backend = "nccl" if device.type == "cuda" else "gloo"
                group = TeacherGroup(box[0], world, rank, backend=backend)
            ch_cfg = ChannelConfig(
                mode="inprocess" if inprocess else "process",
                depth=cfg.parallel.channel_slots,
                timeout_s=cfg.parallel.teacher_timeout_s,
                worker_threads=threads,
            )
            channels.append(TeacherChannel(program, device=device, config=ch_cfg, group=group))
        for ch in channels:
            ch.wait_ready()
    except BaseException:
        for ch in channels:
            ch.close()
        raise
    return channels


def _master_addr() -> str:
    import os

    return os.environ.get("MASTER_ADDR", "127.0.0.1")
