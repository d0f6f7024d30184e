"""The one teacher forward: a loaded teacher model -> the outputs a loss reads.

Every teacher source goes through `teacher_forward` (the trainer's teacher workers, off- and
on-policy, the teacher-cache job, the tests and benchmarks), so all of them give the same
numbers. It never builds full-vocabulary fp32 logits for a whole microbatch: the lm_head is
applied a chunk of positions at a time, each chunk reduced at once to the spec's outputs.

Legend: B rows, U teacher positions, V teacher lm_head width, H hidden size, N columns.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from tokenbridge.dist_ops.dtensor import unwrap_vocab_sharded
from tokenbridge.losses.ops.segments import shift_targets
from tokenbridge.teacher.outputs import (
    TeacherOutputs,
    TeacherOutputSpec,
    Workspace,
    allocate_teacher_outputs,
    fused_mode,
    span_rows,
    teacher_outputs_from_logits,
)


def _whole_vocab(tp_group) -> None:
    if tp_group is not None:
        raise ValueError(
            "teacher_forward: on_logits reads whole-vocabulary logits, but this teacher's "
            "lm_head is vocab-sharded (tp > 1); run it at tp=1"
        )


@torch.no_grad()  # a teacher's outputs are targets: no graph, and the products write `out=`
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
    workspace: Workspace | None = None,
    position_ids_BU: torch.Tensor | None = None,
) -> TeacherOutputs:
    """The spec's teacher outputs for one microbatch, applying the lm_head `chunk` positions at
    a time (HF causal LMs with ``.model`` + ``.lm_head``; others get full logits). A vocab-
    sharded lm_head (TP) gives DTensor logits: the outputs are computed on the local shard.

    ``columns``: fixed global ids [N] (the exact-map teacher ids of `gold`), or per position
    [B, U, N] (on-policy top-k: the student's own top-k ids at each position), or None.

    ``used_BU`` (bool [B, U]): only those positions get outputs: the model body still runs over
    every token (each position's context), but the lm_head (for Gemma 170M of its 270M
    parameters, 262,144 columns) and the output reductions run on the used rows only, gathered.
    The other positions are filled NaN (ids -1), so a loss that read one would fail loudly.
    ``on_logits``: called as ``on_logits(t0, logits)`` with each chunk's (softcapped) logits
    [B, n, V] (the teacher cache samples ids from them; whole vocabulary: refused under TP);
    not with ``used_BU``.
    ``workspace``: buffers for the [rows, V] products and passes (`Workspace`), reused by
    every span; a fresh one for this call when None (what the trainer and the cache job do).
    ``position_ids_BU``: packed rows (several documents per row), position ids restarting at
    every document; the model then gets them and no 2-D mask, and transformers masks attention
    by document (its packed-sequence detection). ``mask_BU`` still gives each row's length.
    """
    if on_logits is not None and used_BU is not None:
        raise ValueError("teacher_forward: on_logits sees every position; it takes no used_BU")
    len_B = mask_BU.sum(1)
    tgt_BU = shift_targets(ids_BU, len_B) if spec.target else None
    if tgt_BU is not None and position_ids_BU is not None:
        # packed rows: a document's last token predicts nothing (the next one starts another)
        tgt_BU[:, :-1].masked_fill_(position_ids_BU[:, 1:] == 0, -1)
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    # packed rows: position ids and no 2-D mask (transformers then masks by document)
    rows = (
        {"attention_mask": mask_BU}
        if position_ids_BU is None
        else {"position_ids": position_ids_BU}
    )
    inputs = {"input_ids": ids_BU, "use_cache": False, **rows}
    if base is None or head is None:
        out = model(**inputs).logits
        logits, tp_group = unwrap_vocab_sharded(out)
        if on_logits is not None:
            _whole_vocab(tp_group)
            on_logits(0, logits)
        out = teacher_outputs_from_logits(
            logits, spec=spec, target_ids_BT=tgt_BU, columns=columns, tp_group=tp_group
        )
        return out if used_BU is None else _blank_unused(out, used_BU)
    hidden_BUH = base(**inputs).last_hidden_state
    # Gemma caps its logits (tanh); the HF model does it after its lm_head, so we do too
    softcap = getattr(model.config, "final_logit_softcapping", None)
    workspace = workspace or Workspace()
    # a plain lm_head writes its product into a reused buffer, in the model's dtype
    plain = (
        type(head) is torch.nn.Linear
        and head.bias is None
        and not isinstance(head.weight, DTensor)  # TP: the module's own hooks shard it
    )
    # its cap is left to the fused pass (in fp32, in the same read), unless on_logits reads
    # capped logits; other heads cap out of place below
    fused = (
        plain and fused_mode(spec, ids_BU.device, dtype=head.weight.dtype, softcap=softcap) != "off"
    )
    defer = softcap if fused and on_logits is None else None
    if ids_BU.device.type == "cuda":  # spans of `span_rows` rows: fewer launches a token
        chunk = max(chunk, span_rows(spec, ids_BU.device) // max(1, ids_BU.shape[0]))

    def logits_of(h_BnH):
        """(logits [B, n, V], tp group): this rank's vocabulary shard under TP, softcapped
        unless ``defer``."""
        if plain:
            B, n, H = h_BnH.shape
            w_VH = head.weight
            buf = workspace.get("logits", B * n, w_VH.shape[0], h_BnH.device, w_VH.dtype)
            # one [B*n, H] product (the span is contiguous), written into the buffer
            torch.mm(h_BnH.reshape(B * n, H), w_VH.t(), out=buf)
            if softcap and not defer:
                buf.div_(softcap).tanh_().mul_(softcap)
            return buf.view(B, n, -1), None
        logits, group = unwrap_vocab_sharded(head(h_BnH))
        return (torch.tanh(logits / softcap) * softcap if softcap else logits), group

    if used_BU is not None and not bool(used_BU.all()):
        return _used_rows_only(
            hidden_BUH,
            tgt_BU,
            used_BU,
            logits_of,
            spec=spec,
            columns=columns,
            chunk=chunk,
            workspace=workspace,
            softcap=defer,
        )
    out = allocate_teacher_outputs(spec, *ids_BU.shape, device=ids_BU.device)
    _fill_by_spans(
        out,
        hidden_BUH,
        logits_of,
        tgt_BU=tgt_BU,
        columns=columns,
        spec=spec,
        step=chunk,
        on_logits=on_logits,
        workspace=workspace,
        softcap=defer,
    )
    return out


def _fill_by_spans(
    out,
    hidden_BUH,
    logits_of,
    *,
    tgt_BU,
    columns,
    spec,
    step,
    on_logits=None,
    workspace=None,
    softcap=None,
):
    """Fill ``out`` [B, U] ``step`` positions at a time: the lm_head on that span of the hidden
    states, then its teacher outputs written in place. ``columns`` [B, U, N] (per position)
    are sliced with the span; any other ``columns`` is passed whole. ``softcap``: the cap
    `logits_of` left to the outputs."""
    U = hidden_BUH.shape[1]
    per_position = columns is not None and columns.dim() == 3
    for t0 in range(0, U, step):
        n = min(step, U - t0)
        # contiguous: a frozen lm_head (no grad) applied to a strided [B, n, H] slice is not
        # folded into one [B*n, H] product by torch.matmul but run as a bmm of B products,
        # each reading the whole 262k x H weight: 2x the build's time at B = 14 (measured)
        logits, tp_group = logits_of(hidden_BUH[:, t0 : t0 + n].contiguous())
        if on_logits is not None:
            _whole_vocab(tp_group)
            on_logits(t0, logits)
        teacher_outputs_from_logits(
            logits,
            spec=spec,
            target_ids_BT=None if tgt_BU is None else tgt_BU[:, t0 : t0 + n],
            columns=columns[:, t0 : t0 + n] if per_position else columns,
            out=out.narrow_t(t0, n),
            tp_group=tp_group,
            workspace=workspace,
            softcap=softcap,
        )


def _used_rows_only(
    hidden_BUH, tgt_BU, used_BU, logits_of, *, spec, columns, chunk, workspace, softcap
):
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
    _fill_by_spans(
        flat,
        h_N,
        logits_of,
        tgt_BU=t_N,
        columns=c_N,
        spec=spec,
        step=step,
        workspace=workspace,
        softcap=softcap,
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
