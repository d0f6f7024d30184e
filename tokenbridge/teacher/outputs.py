"""The one structure a teacher hands the loss, and how it is computed from teacher logits.

A teacher never ships fp32 [T, V_teacher] logits, only what the configured loss reads per
position: top-k + tail, log-probs on a column set, a sorted rest, the realised token's log-prob
(the fields: docs/losses.md, "Teacher outputs"). Every field's shape is fixed by (B, T, spec), so
a worker preallocates ring slots (shared memory or CUDA IPC) and fills them in place (``out=``).

Legend: B batch, T teacher positions, V teacher lm_head width, K top-k, N columns, M sorted rest.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from tokenbridge.dist_ops import vocab_ops
from tokenbridge.teacher import blocked, fused_topk

NEG_INF = float("-inf")
CUDA_SPAN_ROWS = 2048  # rows of a fused pass on CUDA: its ~20 launches amortised over 0.5 GB

FIELD_NAMES = (
    "topk_ids",
    "topk_logprobs",
    "tail_logprob",
    "col_ids",
    "col_logprobs",
    "col_rest_logprob",
    "rest_sorted_probs",
    "target_logprob",
)


@dataclass(frozen=True)
class TeacherOutputSpec:
    """Which fields a loss needs, and their sizes."""

    vocab_size: int  # teacher tokenizer vocab; lm_head columns >= this are masked
    topk: int = 0  # K; 0 = no top-k fields
    columns: int = 0  # N; 0 = no column fields
    per_position_columns: bool = False  # column ids given per position ([B, T, N]) not global [N]
    rest_sorted: int = 0  # M; 0 = no sorted rest
    target: bool = False
    temperature: float = 1.0  # applies to top-k, columns and sorted rest (not to target_logprob)
    column_dtype: torch.dtype = torch.float32  # bf16 halves the transport of large column sets
    chunk_size: int = 256  # rows (B * T positions) processed at once

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or min(self.topk, self.columns, self.rest_sorted) < 0:
            raise ValueError(f"invalid TeacherOutputSpec sizes: {self}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.rest_sorted and not self.columns:
            raise ValueError("rest_sorted needs a column set (it is the rest outside the columns)")
        if self.per_position_columns and not self.columns:
            raise ValueError("per_position_columns needs columns > 0")
        if self.topk + self.columns + self.rest_sorted == 0 and not self.target:
            raise ValueError("TeacherOutputSpec asks for nothing")

    def union(self, other: TeacherOutputSpec) -> TeacherOutputSpec:
        """One spec serving two losses (e.g. xtoken + alm) of the same teacher."""
        if (self.vocab_size, self.temperature) != (other.vocab_size, other.temperature):
            raise ValueError("cannot merge teacher specs with different vocab_size or temperature")
        if (
            self.columns
            and other.columns
            and (
                (self.columns, self.per_position_columns)
                != (other.columns, other.per_position_columns)
            )
        ):
            raise ValueError("cannot merge teacher specs with different column sets")
        src = self if self.columns else other
        return replace(
            self,
            topk=max(self.topk, other.topk),
            columns=src.columns,
            per_position_columns=src.per_position_columns,
            rest_sorted=max(self.rest_sorted, other.rest_sorted),
            target=self.target or other.target,
            column_dtype=src.column_dtype,
        )


def teacher_output_fields(
    spec: TeacherOutputSpec, batch: int, seq: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every field the spec needs, for preallocation."""
    b, t = batch, seq
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if spec.topk:
        out["topk_ids"] = ((b, t, spec.topk), torch.int32)
        out["topk_logprobs"] = ((b, t, spec.topk), torch.float32)
        out["tail_logprob"] = ((b, t), torch.float32)
    if spec.columns:
        if spec.per_position_columns:
            out["col_ids"] = ((b, t, spec.columns), torch.int32)
        out["col_logprobs"] = ((b, t, spec.columns), spec.column_dtype)
        out["col_rest_logprob"] = ((b, t), torch.float32)
    if spec.rest_sorted:
        out["rest_sorted_probs"] = ((b, t, spec.rest_sorted), torch.float32)
    if spec.target:
        out["target_logprob"] = ((b, t), torch.float32)
    return out


@dataclass
class TeacherOutputs:
    """What a teacher ships for one microbatch; fields not in the spec are None."""

    topk_ids: Tensor | None = None  # int32 [B, T, K], -1 = empty slot
    topk_logprobs: Tensor | None = None  # [B, T, K]
    tail_logprob: Tensor | None = None  # [B, T]
    col_ids: Tensor | None = None  # int32 [B, T, N], only for per-position columns
    col_logprobs: Tensor | None = None  # [B, T, N]
    col_rest_logprob: Tensor | None = None  # [B, T]
    rest_sorted_probs: Tensor | None = None  # [B, T, M], descending
    target_logprob: Tensor | None = None  # [B, T], temperature 1, 0 where no target

    def tensors(self) -> dict[str, Tensor]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def narrow_t(self, start: int, length: int) -> TeacherOutputs:
        """Views of positions [start, start + length) (to fill a slot chunk by chunk)."""
        return TeacherOutputs(**{k: v.narrow(1, start, length) for k, v in self.tensors().items()})

    def cp_shard(self, cp) -> TeacherOutputs:
        """This context-parallel rank's positions (`CPContext.shard` on dim 1): per-position
        outputs of whole rows, re-laid out for a student that holds T / CP of them."""
        return TeacherOutputs(**{k: cp.shard(v, dim=1) for k, v in self.tensors().items()})

    def to(self, device) -> TeacherOutputs:
        return TeacherOutputs(**{k: v.to(device) for k, v in self.tensors().items()})

    def require(self, names: tuple[str, ...], *, mode: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(
                f"{mode} needs teacher outputs {missing}; build them with the spec from "
                f"{mode}_teacher_spec(...)"
            )


class Workspace:
    """Buffers of the teacher's [rows, V] passes (the lm_head's product, the exp of the
    reductions), reused by every span of positions of one call (`teacher_forward`). On CPU
    every fresh [256, 262144] fp32 tensor (268 MB) is mapped anew by the allocator and paid
    again in page faults, ~70 ms each on a 2-core EPYC against 13 ms for the pass itself; a
    cache build's batch of 14 rows has 15 spans. Not kept between calls: held by a worker, two
    of them raised the live run's peak by 0.28 GiB, for ~3% of the build's time. On a GPU the caching
    allocator already reuses memory: no buffer is kept there."""

    def __init__(self) -> None:
        self._bufs: dict[str, Tensor] = {}

    def get(
        self, name: str, rows: int, width: int, device, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """An uninitialised [rows, width] view of buffer ``name``, grown when too small."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(rows, width, device=device, dtype=dtype)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * width or buf.dtype != dtype:
            buf = self._bufs[name] = torch.empty(rows * width, dtype=dtype)
        return buf[: rows * width].view(rows, width)


def allocate_teacher_outputs(
    spec: TeacherOutputSpec, batch: int, seq: int, *, device=None, share_memory: bool = False
) -> TeacherOutputs:
    out = {}
    for name, (shape, dtype) in teacher_output_fields(spec, batch, seq).items():
        t = torch.zeros(shape, dtype=dtype, device=device)
        out[name] = t.share_memory_() if share_memory else t
    return TeacherOutputs(**out)


def _check_inputs(logits_BTV, spec, target_ids_BT, columns, tp_group) -> None:
    if logits_BTV.dim() != 3:
        raise ValueError(f"teacher logits must be [B, T, V], got {tuple(logits_BTV.shape)}")
    b, t, width = logits_BTV.shape
    if tp_group is not None:  # the last dim is this rank's shard of an evenly split lm_head
        import torch.distributed as dist

        width *= dist.get_world_size(tp_group)
    if spec.vocab_size > width:
        raise ValueError(f"spec.vocab_size {spec.vocab_size} > teacher lm_head width {width}")
    if spec.topk > spec.vocab_size:
        raise ValueError(f"top-k {spec.topk} > teacher vocab_size {spec.vocab_size}")
    if spec.target and (target_ids_BT is None or tuple(target_ids_BT.shape) != (b, t)):
        raise ValueError(f"spec.target needs target_ids of shape {(b, t)} (shifted, -1 = none)")
    if spec.columns:
        want = (b, t, spec.columns) if spec.per_position_columns else (spec.columns,)
        if columns is None or tuple(columns.shape) != want:
            got = None if columns is None else tuple(columns.shape)
            raise ValueError(f"spec.columns needs column ids of shape {want}, got {got}")
        if bool((columns >= spec.vocab_size).any()):
            raise ValueError(f"column ids must be < teacher vocab_size {spec.vocab_size}")
        if spec.rest_sorted > spec.vocab_size - (
            spec.columns if not spec.per_position_columns else 0
        ):
            raise ValueError(f"rest_sorted {spec.rest_sorted} exceeds the columns outside the set")


@torch.no_grad()
def _rows(x_RV, spec, tgt_R, cols, tp_group, softcap) -> dict[str, Tensor]:
    """All requested fields for R rows of raw teacher logits (vocab-parallel composition)."""
    x1 = vocab_ops.mask_padded(_upcast_capped(x_RV, softcap), spec.vocab_size, tp_group=tp_group)
    xs = x1 if spec.temperature == 1.0 else x1 / spec.temperature
    logz = vocab_ops.logsumexp(xs, tp_group)
    logz = torch.where(torch.isfinite(logz), logz, 0.0)  # an all -inf row -> all-zero outputs
    out: dict[str, Tensor] = {}
    if spec.topk:
        vals, ids = vocab_ops.topk(xs, spec.topk, tp_group)
        lp = vals - logz[:, None]
        ids = torch.where(lp > NEG_INF, ids, -1)
        out["topk_ids"] = ids
        out["topk_logprobs"] = lp
        out["tail_logprob"] = vocab_ops.logsumexp_excluding(xs, ids, tp_group) - logz
    if spec.columns:
        out["col_logprobs"] = vocab_ops.gather(xs, cols, tp_group) - logz[:, None]
        out["col_rest_logprob"] = vocab_ops.logsumexp_excluding(xs, cols, tp_group) - logz
        if spec.per_position_columns:
            out["col_ids"] = cols
    if spec.rest_sorted:
        rest = vocab_ops.exclude_columns(xs, cols, tp_group)
        vals, _ = vocab_ops.topk(rest, spec.rest_sorted, tp_group)
        out["rest_sorted_probs"] = (vals - logz[:, None]).exp()
    if spec.target:
        logz1 = logz if spec.temperature == 1.0 else vocab_ops.logsumexp(x1, tp_group)
        tl = vocab_ops.gather(x1, tgt_R[:, None], tp_group)[:, 0] - logz1
        out["target_logprob"] = torch.where(tgt_R >= 0, tl, 0.0)
    return out


def _zero_cols(e_RV: Tensor, cols: Tensor) -> None:
    """e[:, cols] = 0 in place; cols [N] or [R, N] (-1 = empty slot)."""
    if cols.dim() == 1:
        e_RV.index_fill_(1, cols[cols >= 0], 0.0)
        return
    top = cols.max(-1, keepdim=True).values
    none = top[:, 0] < 0  # rows without any id: their (harmless) writes go to column 0
    keep0 = e_RV[none, 0].clone()
    e_RV.scatter_(1, torch.where(cols >= 0, cols, top.clamp(min=0)), 0.0)
    e_RV[none, 0] = keep0


@torch.no_grad()
def _rows_local(x_RV, spec, tgt_R, cols, workspace: Workspace | None, softcap) -> dict[str, Tensor]:
    """Same fields on one device. Top-k (+ target) without columns: in one fused pass
    (`tokenbridge.teacher.fused_topk`, where `fused_topk.mode` says so) or blocked passes
    (`tokenbridge.teacher.blocked`). Otherwise sharing one exp(x - max) buffer (from
    ``workspace`` when given): every mass outside a set is a sum over that buffer with the set
    zeroed (exact), not 1 - sum and not a masked copy."""
    how = fused_mode(spec, x_RV.device, dtype=x_RV.dtype, softcap=softcap)
    if how != "off":
        tf = fused_topk.Transform(spec.vocab_size, softcap, spec.temperature, spec.target)
        work = None
        if how == "eager" and workspace is not None:
            n = blocked.pass_rows(*x_RV.shape, x_RV.device) * (2 if tf.both else 1)
            work = workspace.get("exp", n, x_RV.shape[1], x_RV.device).view(-1)
        fields_ = fused_topk.topk_fields(x_RV, tgt_R, tf, spec.topk, how=how, work=work)
        if fields_ is not None:
            return fused_topk.spec_fields(fields_, tgt_R)
    x1 = vocab_ops.mask_padded(_upcast_capped(x_RV, softcap), spec.vocab_size)
    xs = x1 if spec.temperature == 1.0 else x1 / spec.temperature
    R, V = xs.shape
    if spec.topk and not spec.columns:
        n = blocked.pass_rows(R, V, xs.device)
        work = workspace.get("exp", n, V, xs.device) if workspace else xs.new_empty(n, V)
        fields_ = blocked.topk_fields(xs, spec.topk, work.view(-1))
        if fields_ is not None:
            return _from_blocked(fields_, spec, x1, tgt_R)
    work_RV = None if workspace is None else workspace.get("exp", R, V, xs.device)
    m = xs.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = (xs - m if work_RV is None else torch.sub(xs, m, out=work_RV)).exp_()
    s_all = e.sum(-1)
    logz = m[:, 0] + s_all.log()
    logz = torch.where(torch.isfinite(logz), logz, 0.0)  # an all -inf row -> all-zero outputs
    out: dict[str, Tensor] = {}
    if spec.topk:
        vals, ids = blocked.topk_blocked(xs, spec.topk)
        lp = vals - logz[:, None]
        live = lp > NEG_INF
        out["topk_ids"] = torch.where(live, ids, -1)
        out["topk_logprobs"] = lp
        saved = e.gather(1, ids)
        e.scatter_(1, ids, 0.0)
        out["tail_logprob"] = m[:, 0] + e.sum(-1).log() - logz
        e.scatter_(1, ids, saved)  # restore exactly
    if spec.columns:
        safe = cols.clamp(min=0)
        gathered = xs.index_select(1, safe) if cols.dim() == 1 else xs.gather(1, safe)
        out["col_logprobs"] = (gathered - logz[:, None]).masked_fill(cols < 0, NEG_INF)
        _zero_cols(e, cols)
        out["col_rest_logprob"] = m[:, 0] + e.sum(-1).log() - logz
        if spec.per_position_columns:
            out["col_ids"] = cols
        if spec.rest_sorted:
            vals, _ = blocked.topk_blocked(e, spec.rest_sorted)
            out["rest_sorted_probs"] = vals / s_all[:, None]
    if spec.target:
        out["target_logprob"] = _target(x1, tgt_R, logz if spec.temperature == 1.0 else None)
    return out


def _upcast_capped(x_RV: Tensor, softcap: float | None) -> Tensor:
    """fp32 logits of raw ``x``, soft-capped when ``softcap`` (in place on fp32 ``x``, as the
    head's product buffer was capped before: the same values)."""
    x1 = x_RV.float()
    return x1.div_(softcap).tanh_().mul_(softcap) if softcap else x1


def fused_mode(spec: TeacherOutputSpec, device, **logits) -> str:
    """How the spec's fields take the fused pass on ``device`` for ``logits`` (dtype, softcap):
    `fused_topk.mode`, or ``off`` for a spec it does not compute (no top-k, or columns); widths
    where its blocks would not pay aside (`blocked.block_size`)."""
    if not spec.topk or spec.columns:
        return "off"
    return fused_topk.mode(device, **logits)


def span_rows(spec: TeacherOutputSpec, device) -> int:
    """Rows of one pass over [rows, V]: ``spec.chunk_size``, and on CUDA at least
    `CUDA_SPAN_ROWS` where the fused pass serves the spec (it holds no fp32 [rows, V])."""
    if torch.device(device).type == "cuda" and fused_mode(spec, device) != "off":
        return max(spec.chunk_size, CUDA_SPAN_ROWS)
    return spec.chunk_size


def _target(x1_RV: Tensor, tgt_R: Tensor, logz1_R: Tensor | None) -> Tensor:
    """log p(next token) at temperature 1 (``logz1``: logZ at temperature 1 when known)."""
    logz1 = torch.logsumexp(x1_RV, -1) if logz1_R is None else logz1_R
    tl = x1_RV.gather(1, tgt_R.clamp(min=0)[:, None])[:, 0] - logz1
    return torch.where(tgt_R >= 0, tl, 0.0)


def _from_blocked(f: dict[str, Tensor], spec, x1_RV: Tensor, tgt_R) -> dict[str, Tensor]:
    """The spec's fields from `blocked.topk_fields`."""
    logz = torch.where(torch.isfinite(f["logz"]), f["logz"], 0.0)  # an all -inf row -> zeros
    lp = f["vals"] - logz[:, None]
    out = {
        "topk_ids": torch.where(lp > NEG_INF, f["ids"], -1),
        "topk_logprobs": lp,
        "tail_logprob": f["tail"] - logz,
    }
    if spec.target:
        out["target_logprob"] = _target(x1_RV, tgt_R, logz if spec.temperature == 1.0 else None)
    return out


@torch.no_grad()
def teacher_outputs_from_logits(
    logits_BTV: Tensor,
    *,
    spec: TeacherOutputSpec,
    target_ids_BT: Tensor | None = None,
    columns: Tensor | None = None,
    out: TeacherOutputs | None = None,
    tp_group=None,
    workspace: Workspace | None = None,
    softcap: float | None = None,
) -> TeacherOutputs:
    """Compute the spec's fields from teacher logits, `span_rows` rows at a time.

    ``target_ids_BT``: the token predicted at each position (`segments.shift_targets`), -1 none.
    ``columns``: global column ids [N], or per-position ids [B, T, N] (-1 = empty slot).
    ``out``: preallocated outputs to fill in place (e.g. a shared-memory slot, or `narrow_t`
    views when the logits arrive in pieces along T); allocated when None.
    ``workspace``: reused buffers for the [rows, V] passes (`Workspace`).
    ``softcap``: the logits are the head's raw output, to be capped (tanh) here: inside the
    fused pass, else on their fp32 copy (fp32 logits: in place).
    """
    _check_inputs(logits_BTV, spec, target_ids_BT, columns, tp_group)
    b, t, width = logits_BTV.shape
    if out is None:
        out = allocate_teacher_outputs(spec, b, t, device=logits_BTV.device)
    dst = out.tensors()
    for name in teacher_output_fields(spec, b, t):
        if name not in dst or dst[name].shape[:2] != (b, t):
            raise ValueError(f"out is missing field {name!r} or has the wrong [B, T]")
    cols = None if columns is None else columns.to(logits_BTV.device, torch.int64)
    step = max(1, span_rows(spec, logits_BTV.device) // max(b, 1))
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        rows = logits_BTV[:, t0:t1].reshape(-1, width)
        tgt = None if target_ids_BT is None else target_ids_BT[:, t0:t1].reshape(-1).long()
        c = cols
        if cols is not None and spec.per_position_columns:
            c = cols[:, t0:t1].reshape(-1, spec.columns)
        if tp_group is None:
            vals = _rows_local(rows, spec, tgt, c, workspace, softcap)
        else:
            vals = _rows(rows, spec, tgt, c, tp_group, softcap)
        for name, val in vals.items():
            view = dst[name][:, t0:t1]
            view.copy_(val.reshape(view.shape))
    return out
