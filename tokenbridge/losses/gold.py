"""`gold`: TRL GOLD's hybrid ULD loss over aligned chunks, with its flaws fixed.

Per chunk, a divergence over the exact map's byte-identical token pairs (plus a rest bucket, so
it is a proper divergence) and the ULD distance of the sorted unmatched probabilities, both on
distributions merged at the chunk's last row. Formulas: docs/losses.md, "`gold`".

Legend: B batch, S student positions, V student width, G chunks, M exact pairs, U student
unmatched columns, W teacher sorted-rest width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tokenbridge.dist_ops import vocab_ops
from tokenbridge.losses.alm import student_chain_sums
from tokenbridge.losses.base import (
    LossOutput,
    OptionError,
    as_count,
    check_divergence,
    check_option,
    compute_dtype,
    divergence,
    empty_loss,
    log1mexp,
    safe_logaddexp,
)
from tokenbridge.losses.ops.cp_chunks import open_chunk_loss, owned_rows
from tokenbridge.losses.ops.fused import matched_cross_rows
from tokenbridge.losses.ops.rowwise import DEFAULT_CHUNK, map_rows, take_rows
from tokenbridge.losses.ops.segments import ChunkIndex, ChunkSide, segment_sum
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec

if TYPE_CHECKING:
    from tokenbridge.dist_ops import CPContext


@dataclass(frozen=True)
class GoldConfig:
    divergence: str = "forward"
    beta: float = 0.5
    temperature: float = 1.0
    rest_bucket: bool = True
    matched_weight: float | None = None  # None: TRL's adaptive M / V_t (and 1 - that)
    unmatched_weight: float | None = None
    uld_width: int | None = None  # None: |U_s| (exact)

    def __post_init__(self) -> None:
        check_divergence(self)
        check_option(self, "temperature", self.temperature > 0, "> 0")
        check_option(self, "uld_width", self.uld_width is None or self.uld_width >= 1, ">= 1")
        if (self.matched_weight is None) != (self.unmatched_weight is None):
            unset = "unmatched_weight" if self.unmatched_weight is None else "matched_weight"
            raise OptionError("GoldConfig", unset, "set both weights, or neither (TRL's M / V_t)")


@dataclass(frozen=True)
class GoldTables:
    t_ids: Tensor  # int64 [M] teacher side of the exact pairs (the teacher's column set)
    s_ids: Tensor  # int64 [M] student side, distinct
    s_unmatched: Tensor  # int64 [U] valid student columns outside s_ids
    teacher_vocab_size: int

    @staticmethod
    def from_exact_map(
        exact_t2s, *, teacher_vocab_size: int, student_vocab_size: int
    ) -> GoldTables:
        """From ``exact_t2s`` (per teacher id, the byte-identical student id or -1).

        A student id claimed by several teacher ids keeps the first (a category must appear once
        on each side); the other teacher ids count as unmatched.
        """
        # rows past the teacher's tokenizer (a padded lm_head) and student ids past the student's
        # tokenizer are never real tokens: they cannot pair
        e = np.asarray(exact_t2s, dtype=np.int64)[:teacher_vocab_size]
        t = np.nonzero((e >= 0) & (e < student_vocab_size))[0]
        s = e[t]
        # t is ascending, so np.unique's first index keeps the smallest teacher id per student id
        s_first, first_idx = np.unique(s, return_index=True)
        t = t[first_idx]
        if t.size == 0:
            raise ValueError(
                "gold: the exact map is empty (no teacher token has a byte-identical student "
                "token within the vocab sizes); the matched KL would silently be 0"
            )
        # pairs in teacher-id order: the teacher ships its columns in the order of t_ids
        order = np.argsort(t)
        unmatched = np.setdiff1d(np.arange(student_vocab_size), s_first)
        return GoldTables(
            torch.from_numpy(t[order]),
            torch.from_numpy(s_first[order]),
            torch.from_numpy(unmatched),
            teacher_vocab_size,
        )

    @staticmethod
    def from_projection(
        projection, *, teacher_vocab_size: int, student_vocab_size: int
    ) -> GoldTables:
        return GoldTables.from_exact_map(
            projection.exact_t2s,
            teacher_vocab_size=teacher_vocab_size,
            student_vocab_size=student_vocab_size,
        )

    def to(self, device) -> GoldTables:
        return GoldTables(
            self.t_ids.to(device),
            self.s_ids.to(device),
            self.s_unmatched.to(device),
            self.teacher_vocab_size,
        )

    def weights(self, config: GoldConfig) -> tuple[float, float]:
        if config.matched_weight is not None:
            return config.matched_weight, float(config.unmatched_weight)
        w = self.t_ids.numel() / self.teacher_vocab_size
        return w, 1.0 - w


def gold_teacher_spec(
    config: GoldConfig, tables: GoldTables, *, teacher_vocab_size: int
) -> TeacherOutputSpec:
    m = tables.t_ids.numel()
    width = tables.s_unmatched.numel() if config.uld_width is None else config.uld_width
    return TeacherOutputSpec(
        teacher_vocab_size,
        columns=m,
        rest_sorted=max(1, min(width, teacher_vocab_size - m)),
        target=True,
        temperature=config.temperature,
    )


def _prefix_rows(side: ChunkSide, wanted_G1: Tensor) -> Tensor:
    """Positions predicting a token of a wanted chunk that is NOT the chunk's last token."""
    tc = side.target_chunk
    in_chunk = wanted_G1[tc] & (tc >= 0)
    last = side.last[tc.clamp(min=0)]
    pos = torch.arange(tc.numel(), device=tc.device)
    return (in_chunk & (pos + 1 != last)).nonzero().squeeze(1)


def _tail_terms(kl, qu, lpre, trest, tsorted, tresid, *, config, weights):
    """The rest bucket of the matched part and the ULD part, from log u_s at the unmatched
    columns ``qu`` [r, U]; returns (terms, matched, unmatched) per row."""
    if config.rest_bucket:  # every divergence is a sum over categories: add the rest bucket's
        # the student's rest: its unmatched mass after the chunk's earlier tokens, plus
        # 1 - exp(lpre), the probability that the text did not go on with those tokens at all
        q_rest = safe_logaddexp(torch.logsumexp(qu, -1), log1mexp(lpre))
        kl = kl + divergence(
            trest.to(qu.dtype)[:, None], q_rest[:, None], kind=config.divergence, beta=config.beta
        )
    # ULD compares the unmatched values by rank, not by token (the vocabularies differ there):
    # both sides sorted descending, the shorter zero-padded
    s_sorted = qu.exp().sort(dim=-1, descending=True).values
    t_sorted = tsorted.to(qu.dtype)
    width = max(s_sorted.shape[-1], t_sorted.shape[-1])
    s_sorted = F.pad(s_sorted, (0, width - s_sorted.shape[-1]))
    t_sorted = F.pad(t_sorted, (0, width - t_sorted.shape[-1]))
    # tresid: the teacher's unmatched mass it did not ship (uld_width < |U_s|), against zeros
    uld = (s_sorted - t_sorted).abs().sum(-1) + tresid.to(qu.dtype)
    return weights[0] * kl + weights[1] * uld, kl.detach(), uld.detach()


def _gold_block(
    block_cV,
    local_r,
    lpre_r,
    tr_r,
    trest_r,
    tsorted_rW,
    tresid_r,
    *,
    cols_TM,
    lt_pre_of,
    tables,
    config,
    vocab_size,
    weights,
    tp_group,
):
    """The composed path (a tp_group, or reverse / jsd): one block of rows under recompute."""
    dtype = compute_dtype(block_cV)
    lpre = lpre_r.to(dtype)
    tm = cols_TM[tr_r].to(dtype) + lt_pre_of(tr_r).to(dtype)[:, None]
    x = take_rows(block_cV, local_r).to(dtype)
    x = vocab_ops.mask_padded(x, vocab_size, tp_group=tp_group)
    if config.temperature != 1.0:
        x = x / config.temperature
    logz = vocab_ops.logsumexp(x, tp_group)[:, None]
    xm = vocab_ops.gather(x, tables.s_ids, tp_group) - logz + lpre[:, None]
    kl = divergence(tm, xm, kind=config.divergence, beta=config.beta)
    qu = vocab_ops.gather(x, tables.s_unmatched, tp_group) - logz + lpre[:, None]
    return _tail_terms(kl, qu, lpre, trest_r, tsorted_rW, tresid_r, config=config, weights=weights)


@torch.no_grad()
def _teacher_matched_stats(tm_of, n: int, chunk: int) -> tuple[Tensor, Tensor]:
    """(sum_m P_m log P_m, sum_m P_m) per row, P = exp(log P) built block by block."""
    ent, mass = [], []
    for a in range(0, n, chunk):
        tm = tm_of(a, min(n, a + chunk))
        p = tm.exp()
        live = p > 0
        ent.append(torch.where(live, p * torch.where(live, tm, 0.0), 0.0).sum(-1))
        mass.append(p.sum(-1))
    return torch.cat(ent), torch.cat(mass)


def gold(
    student_logits_BSV: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    *,
    tables: GoldTables,
    vocab_size: int,
    config: GoldConfig,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
    cp: CPContext | None = None,
) -> LossOutput:
    """Hybrid exact-map KL + sorted-probability L1 over aligned chunks (docs/losses.md, "`gold`").

    Under CP (``cp``: logits in the CP layout, index over whole rows) a chunk's term is computed
    and counted by the rank holding the row that predicts its last token (`context`).
    """
    fields = ("col_logprobs", "col_rest_logprob", "rest_sorted_probs", "target_logprob")
    logits, chunks, metrics = open_chunk_loss(
        "gold", student_logits_BSV, teacher, index, cp, fields=fields
    )
    if teacher.col_logprobs.shape[-1] != tables.t_ids.numel():
        raise ValueError(
            f"gold: teacher shipped {teacher.col_logprobs.shape[-1]} columns, the exact map has "
            f"{tables.t_ids.numel()} pairs (build the teacher outputs with columns=tables.t_ids)"
        )
    if chunks.numel() == 0:
        return empty_loss(logits, metrics)
    st, te = index.student, index.teacher
    g = index.n_chunks
    wanted = torch.zeros(g + 1, dtype=torch.bool, device=chunks.device)
    wanted[chunks] = True
    # chain prefixes: every token of the chunk but the last, temperature 1; under CP each rank
    # scores the prefix tokens it holds and the sums are finished over the group
    t_pre_rows = _prefix_rows(te, wanted)
    t_lp = teacher.target_logprob.reshape(-1).float()
    lt_pre = segment_sum(t_lp[t_pre_rows], te.target_chunk[t_pre_rows], g)[chunks]
    ls_pre_all = student_chain_sums(
        logits,
        st,
        _prefix_rows(st, wanted),
        n_chunks=g,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        tp_group=tp_group,
        cp=cp,
    )[chunks]
    # the chunk's term lives on the rank holding the student row predicting its last token
    sr, own = owned_rows(st.last_rows()[chunks], cp)
    chunks, lt_pre, ls_pre = chunks[own], lt_pre[own], ls_pre_all[own]
    count = as_count(chunks.numel(), logits.device)
    if chunks.numel() == 0:  # keep the CP all-reduce of the chains in the graph (`context`)
        return LossOutput(ls_pre.sum(), count, metrics)
    # teacher side at the row predicting each chunk's last token
    tr = te.last_rows()[chunks]
    m = tables.t_ids.numel()
    cols_TM = teacher.col_logprobs.reshape(-1, m)  # [G, M] merged rows are built per block
    # the teacher's rest bucket, as the student's: its unmatched mass after the chunk's earlier
    # tokens (scaled by their chain probability), plus 1 - exp(lt_pre)
    t_um = teacher.col_rest_logprob.reshape(-1)[tr].float()
    t_rest = safe_logaddexp(t_um + lt_pre, log1mexp(lt_pre))
    w_sorted = teacher.rest_sorted_probs.shape[-1]
    t_sorted = teacher.rest_sorted_probs.reshape(-1, w_sorted)[tr].float()
    scale = lt_pre.exp()[:, None]
    # unmatched mass past the shipped sorted values (clamped: float error can make it < 0)
    t_resid = (t_um.exp() - t_sorted.sum(-1)).clamp(min=0) * scale[:, 0]
    weights = tables.weights(config)
    tables = tables.to(logits.device)
    if tp_group is None and config.divergence == "forward":
        # KL(P || Q) over the matched ids = sum P log P - sum P (ls_pre - logz + x_s): fused, one
        # gather over the M columns per block, no log-softmax, nothing of size V kept
        logz, cross, xu, ent, p_mass = matched_cross_rows(
            logits,
            sr,
            lambda a, b: cols_TM[tr[a:b]].float() + lt_pre[a:b, None],
            s_ids=tables.s_ids,
            other_ids=tables.s_unmatched,
            vocab_size=vocab_size,
            temperature=config.temperature,
            chunk_size=chunk_size,
        )
        kl = ent - cross - (ls_pre - logz) * p_mass
        qu = xu - logz[:, None] + ls_pre[:, None]
        terms, kl, uld = _tail_terms(
            kl, qu, ls_pre, t_rest, t_sorted * scale, t_resid, config=config, weights=weights
        )
    else:
        _, p_mass = _teacher_matched_stats(
            lambda a, b: cols_TM[tr[a:b]].float() + lt_pre[a:b, None], tr.numel(), chunk_size
        )
        pre_of_row = torch.zeros(cols_TM.shape[0], dtype=lt_pre.dtype, device=lt_pre.device)
        pre_of_row[tr] = lt_pre
        fn = partial(
            _gold_block,
            cols_TM=cols_TM,
            lt_pre_of=lambda rows: pre_of_row[rows],
            tables=tables,
            config=config,
            vocab_size=vocab_size,
            weights=weights,
            tp_group=tp_group,
        )
        terms, kl, uld = map_rows(
            fn, logits, sr, ls_pre, tr, t_rest, t_sorted * scale, t_resid, chunk_size=chunk_size
        )
    total = terms.sum()
    metrics.update(
        {
            "kd_sum": total.detach(),
            "gold_matched_sum": kl.sum(),
            "gold_unmatched_sum": uld.sum(),
            "teacher_matched_mass_sum": p_mass.sum(),
        }
    )
    return LossOutput(total, count, metrics)
