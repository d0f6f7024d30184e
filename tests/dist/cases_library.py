"""The invariance matrix for the real loss library (tokenbridge/losses) on TP x CP x DP shards.

Same check as `cases_loss.check_invariance`: the loss of the whole batch on 1 process vs the
summed local sums / global count of every rank, and each rank's gradient vs its slice. Inputs are
built the way the trainer will: teacher outputs computed once from teacher logits
(`teacher_outputs_from_logits`), then every per-position tensor moved into the rank's DP rows
and CP layout; student logits sliced to the rank's TP vocab shard (lm_head width 20 with 3
padded columns, so the padding lives on the last TP shard).

Every mode runs on all 7 layouts. The chunk modes (`alm`, `xtoken`, `gold`) index aligned chunks
by full-sequence positions and sum chain log-probs over a chunk's tokens before a nonlinearity:
they get the whole (DP-local) rows for their `ChunkIndex`, the whole teacher outputs, the student
logits in the CP layout and a `CPContext` (tokenbridge/losses/ops/cp_chunks.py). Their `_short` cases hold
one short chunk per row, so every chunk lives in the first CP piece and CP rank 1 owns none: its
loss must still join the backward all-reduce of the chain sums (a hang otherwise).
Legend: B rows, S student width, T teacher width, V lm_head width.
"""

from __future__ import annotations

import torch

from tests.dist.cases_loss import MATRIX_LAYOUTS, check_invariance
from tests.dist.harness import Ctx, case
from tokenbridge.dist_ops import CPContext
from tokenbridge.dist_ops.collectives import all_reduce_
from tokenbridge.losses import (
    AlignedBatch,
    AlmConfig,
    GoldConfig,
    GoldTables,
    KDTopKConfig,
    TeacherOutputs,
    TeacherOutputSpec,
    XTokenConfig,
    XTokenTables,
    alm,
    alm_teacher_spec,
    ce,
    collate_aligned,
    gold,
    gold_teacher_spec,
    index_chunks,
    kd_topk,
    kd_topk_teacher_spec,
    shift_targets,
    student_topk_ids,
    teacher_outputs_from_logits,
    xtoken,
    xtoken_teacher_spec,
)

B, S, T = 3, 16, 16
VS, VS_W = 17, 20  # student tokenizer vocab, lm_head width
VT, VT_W = 22, 24
CHUNK_ROWS = 5  # the library's row blocks: borders inside rows


def make_aligned(gen: torch.Generator, *, max_chunks: int = 4) -> AlignedBatch:
    """B rows of BOS, 1-max_chunks aligned chunks (1-3 tokens a side: 1:1, 1:N, N:1, N:M), EOS."""
    rows = []
    for b in range(B):
        s_ids, s_ch, t_ids, t_ch = [VS - 1], [-1], [VT - 1], [-1]
        n_chunks = 1 + (b + int(torch.randint(0, 4, (1,), generator=gen))) % max_chunks
        for c in range(n_chunks):
            ns, nt = (int(x) for x in torch.randint(1, 4, (2,), generator=gen))
            s_ids += torch.randint(0, VS - 2, (ns,), generator=gen).tolist()
            t_ids += torch.randint(0, VT - 2, (nt,), generator=gen).tolist()
            s_ch += [c] * ns
            t_ch += [c] * nt
        rows.append(
            {
                "student_ids": s_ids + [VS - 2],
                "teacher0_ids": t_ids + [VT - 2],
                "teacher0_student_chunk": s_ch + [-1],
                "teacher0_chunk": t_ch + [-1],
                "teacher0_n_chunks": len(set(s_ch)) - 1,
            }
        )
    ab = collate_aligned(rows, 0)

    def pad(x: torch.Tensor, width: int, fill: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)

    return AlignedBatch(
        student_ids=pad(ab.student_ids, S, 0),
        student_len=ab.student_len,
        student_chunk=pad(ab.student_chunk, S, -1),
        teacher_ids=pad(ab.teacher_ids, T, 0),
        teacher_len=ab.teacher_len,
        teacher_chunk=pad(ab.teacher_chunk, T, -1),
        n_chunks=ab.n_chunks,
    )


def _rows_of(ab: AlignedBatch, shard) -> AlignedBatch:
    """The DP rows of an aligned batch, whole: chunk modes index full-sequence positions."""
    return AlignedBatch(**{k: shard(getattr(ab, k), vocab=False, seq=False) for k in _AB_FIELDS})


_AB_FIELDS = (
    "student_ids",
    "student_len",
    "student_chunk",
    "teacher_ids",
    "teacher_len",
    "teacher_chunk",
    "n_chunks",
)


def _teacher_view(te: TeacherOutputs, shard, *, seq: bool) -> TeacherOutputs:
    return TeacherOutputs(**{k: shard(v, vocab=False, seq=seq) for k, v in te.tensors().items()})


def _logits(gen: torch.Generator, rows: int, width: int, vocab: int, cols: int) -> torch.Tensor:
    x = torch.randn(rows, width, cols, generator=gen) * 2.5
    x[..., vocab:] = 40.0  # padded lm_head columns: forgetting the mask changes everything
    return x


def _ce(ctx: Ctx) -> None:
    gen = ctx.generator("data")
    ab = make_aligned(gen)
    student = _logits(gen, B, S, VS, VS_W)
    targets = shift_targets(ab.student_ids, ab.student_len)

    def run(s, groups, shard):
        out = ce(
            s,
            shard(targets, vocab=False),
            vocab_size=VS,
            chunk_size=CHUNK_ROWS,
            tp_group=groups.tp,
        )
        return out.sum, out.count

    check_invariance(ctx, student, run)
    # the argmax-hit metric needs the global max over the vocab shards: make every other
    # target the argmax, so hits and misses both occur
    boost = torch.zeros_like(student)
    boost.scatter_(-1, targets.clamp(min=0)[..., None], 12.0)
    student = student + boost * (torch.arange(S) % 2 == 0)[None, :, None]
    ref = ce(student, targets, vocab_size=VS)
    ref_hits = ref.metrics["ce_correct"]
    local = ctx.local(student, vocab=True)
    out = ce(local, ctx.local(targets, vocab=False), vocab_size=VS, tp_group=ctx.groups.tp)
    hits = out.metrics["ce_correct"].clone()
    all_reduce_(all_reduce_(hits, ctx.groups.dp), ctx.groups.cp)
    ctx.close("ce_correct", hits, ref_hits)
    ctx.check("ce_correct sees hits and misses", 0 < int(ref_hits) < int(ref.count))


def _kd_topk(ctx: Ctx, *, divergence: str, support: str) -> None:
    gen = ctx.generator("data")
    ab = make_aligned(gen)
    student = _logits(gen, B, S, VS, VS_W)
    teacher = _logits(gen, B, S, VS, VS_W)  # same tokenizer: the teacher speaks student ids
    config = KDTopKConfig(k=4, divergence=divergence, temperature=1.5, support=support)
    spec = kd_topk_teacher_spec(config, teacher_vocab_size=VS)
    mask = shift_targets(ab.student_ids, ab.student_len) >= 0
    cols = None
    if support == "columns":  # on-policy: the teacher scores the student's own top-k
        cols = student_topk_ids(student, config.k, vocab_size=VS)
        if ctx.tp > 1:
            mine = student_topk_ids(
                ctx.local(student, vocab=True), config.k, vocab_size=VS, tp_group=ctx.groups.tp
            )
            ctx.check("student_topk_ids under TP", torch.equal(mine, ctx.local(cols, vocab=False)))
    te = teacher_outputs_from_logits(teacher, spec=spec, columns=cols)

    def run(s, groups, shard):
        out = kd_topk(
            s,
            _teacher_view(te, shard, seq=True),
            shard(mask, vocab=False),
            vocab_size=VS,
            config=config,
            chunk_size=CHUNK_ROWS,
            tp_group=groups.tp,
        )
        return out.sum, out.count

    check_invariance(ctx, student, run)


def _chunk_loss(mode: str, gen: torch.Generator, ab: AlignedBatch):
    """`run(s, groups, shard) -> LossOutput` of one chunk mode, its teacher made from logits."""
    teacher = _logits(gen, B, T, VT, VT_W)
    t_targets = shift_targets(ab.teacher_ids, ab.teacher_len)
    if mode == "alm":
        config = AlmConfig(divergence="kl", temperature=2.0)
        spec, extra, cols = alm_teacher_spec(config, teacher_vocab_size=VT), {}, None
        loss_fn = alm
    elif mode == "xtoken":
        config = XTokenConfig(k=5, divergence="jsd", temperature=1.3, chain_weight=0.5)
        ids = torch.randint(-1, VS, (VT_W, 3), generator=gen)
        tables = XTokenTables.from_arrays(
            ids, torch.rand(VT_W, 3, generator=gen), student_vocab_size=VS
        )
        spec = xtoken_teacher_spec(config, teacher_vocab_size=VT)
        extra, cols = {"tables": tables}, None
        loss_fn = xtoken
    else:
        config = GoldConfig(divergence="forward", temperature=1.2)
        exact = torch.full((VT_W,), -1, dtype=torch.int64)
        exact[torch.randperm(VT, generator=gen)[:9]] = torch.randperm(VS, generator=gen)[:9]
        tables = GoldTables.from_exact_map(exact, teacher_vocab_size=VT, student_vocab_size=VS)
        spec = gold_teacher_spec(config, tables, teacher_vocab_size=VT)
        extra, cols = {"tables": tables}, tables.t_ids
        loss_fn = gold
    te = teacher_outputs_from_logits(teacher, spec=spec, target_ids_BT=t_targets, columns=cols)

    def run(s, groups, shard):
        return loss_fn(
            s,
            _teacher_view(te, shard, seq=False),
            index_chunks(_rows_of(ab, shard)),
            vocab_size=VS,
            config=config,
            chunk_size=CHUNK_ROWS,
            tp_group=groups.tp,
            cp=CPContext(groups.cp, S),
            **extra,
        )

    return run


def _chunk_mode(ctx: Ctx, *, mode: str, max_chunks: int = 4) -> None:
    gen = ctx.generator("data")
    ab = make_aligned(gen, max_chunks=max_chunks)
    student = _logits(gen, B, S, VS, VS_W)
    loss = _chunk_loss(mode, gen, ab)

    def run(s, groups, shard):
        out = loss(s, groups, shard)
        return out.sum, out.count

    check_invariance(ctx, student, run)


def _three_teachers(ctx: Ctx) -> None:
    """Three chunk-mode teachers in one objective: each finishes its chain sums with its own
    CP all-reduce, so every rank must run the three backward all-reduces in the same order."""
    gen = ctx.generator("data")
    ab = make_aligned(gen)
    student = _logits(gen, B, S, VS, VS_W)
    losses = [_chunk_loss(mode, gen, ab) for mode in ("alm", "xtoken", "gold")]

    def run(s, groups, shard):
        outs = [loss(s, groups, shard) for loss in losses]
        return sum(o.sum for o in outs), outs[0].count  # one objective; alm's count divides it

    check_invariance(ctx, student, run)


def _teacher_outputs_tp(ctx: Ctx) -> None:
    """A TP-sharded teacher ships the same outputs as an unsharded one."""
    gen = ctx.generator("data")
    ab = make_aligned(gen)
    teacher = _logits(gen, B, T, VT, VT_W)
    tgt = shift_targets(ab.teacher_ids, ab.teacher_len)
    local = ctx.tp_slice(teacher)
    specs = [
        (
            TeacherOutputSpec(VT, topk=5, columns=6, rest_sorted=4, target=True, temperature=1.7),
            torch.tensor([0, 3, 7, 11, 20, -1]),
        ),
        (
            TeacherOutputSpec(VT, columns=3, per_position_columns=True),
            torch.randint(-1, VT, (B, T, 3), generator=gen),
        ),
    ]
    for i, (spec, cols) in enumerate(specs):
        ref = teacher_outputs_from_logits(teacher, spec=spec, target_ids_BT=tgt, columns=cols)
        got = teacher_outputs_from_logits(
            local, spec=spec, target_ids_BT=tgt, columns=cols, tp_group=ctx.groups.tp
        )
        for name, want in ref.tensors().items():
            ctx.close(f"spec {i} {name}", got.tensors()[name], want)


def _name(layout: tuple[int, int, int]) -> str:
    return "tp{}cp{}dp{}".format(*layout)


for _layout in MATRIX_LAYOUTS:
    _n = _name(_layout)
    case(f"loss_lib_ce_{_n}", _layout)(_ce)
    for _div in ("forward", "reverse", "jsd"):
        case(f"loss_lib_kd_topk_{_div}_{_n}", _layout)(
            lambda ctx, d=_div: _kd_topk(ctx, divergence=d, support="teacher")
        )
    case(f"loss_lib_kd_topk_onpolicy_{_n}", _layout)(
        lambda ctx: _kd_topk(ctx, divergence="forward", support="columns")
    )
    for _mode in ("alm", "xtoken", "gold"):
        case(f"loss_lib_{_mode}_{_n}", _layout)(lambda ctx, m=_mode: _chunk_mode(ctx, mode=m))
        if _layout[1] == 2:
            case(f"loss_lib_{_mode}_short_{_n}", _layout)(
                lambda ctx, m=_mode: _chunk_mode(ctx, mode=m, max_chunks=1)
            )
    if _layout[1] == 2:
        case(f"loss_lib_three_teachers_{_n}", _layout)(_three_teachers)

case("tp2_teacher_outputs_from_logits", (2, 1, 2))(_teacher_outputs_tp)
case("tp4_teacher_outputs_from_logits", (4, 1, 1))(_teacher_outputs_tp)
