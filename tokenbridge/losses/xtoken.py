"""`xtoken`: cross-tokenizer KD per aligned chunk, through the sparse teacher->student projection.

At each chunk start both models predict the next piece of the same text; both distributions are
pooled into common student-token buckets (`xtoken_tables`) plus a rest bucket and compared
there; inner positions of multi-token chunks get only the optional chain term. Formulas:
docs/losses.md, "`xtoken`".

Legend: B batch, S student positions, V student width, G chunks, K teacher top-k,
P projection slots per teacher token, L = K * P support slots, R teacher rows of the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tokenbridge.dist_ops import vocab_ops
from tokenbridge.losses.alm import binary_divergence, chunk_chains
from tokenbridge.losses.base import (
    LossOutput,
    as_count,
    check_divergence,
    check_option,
    compute_dtype,
    divergence_terms,
    empty_loss,
    safe_log,
    zero_sum_like,
)
from tokenbridge.losses.ops.cp_chunks import open_chunk_loss, owned_rows, replicated
from tokenbridge.losses.ops.fused import logprobs_at_rows
from tokenbridge.losses.ops.rowwise import DEFAULT_CHUNK, map_rows, take_rows
from tokenbridge.losses.ops.segments import ChunkIndex, dedup_rows
from tokenbridge.losses.ops.xtoken_tables import XTokenTables
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec

if TYPE_CHECKING:
    from tokenbridge.dist_ops import CPContext


@dataclass(frozen=True)
class XTokenConfig:
    k: int = 32  # teacher top-k shipped per position
    divergence: str = "forward"
    beta: float = 0.5
    temperature: float = 1.0
    chain_weight: float = 0.0  # > 0: binarised chain-likelihood term on multi-token chunks

    def __post_init__(self) -> None:
        check_divergence(self)
        check_option(self, "k", self.k >= 1, ">= 1")
        check_option(self, "temperature", self.temperature > 0, "> 0")
        check_option(self, "chain_weight", self.chain_weight >= 0, ">= 0")


def xtoken_teacher_spec(config: XTokenConfig, *, teacher_vocab_size: int) -> TeacherOutputSpec:
    return TeacherOutputSpec(
        teacher_vocab_size,
        topk=config.k,
        target=config.chain_weight > 0,
        temperature=config.temperature,
    )


def project_teacher(
    ids_GK: Tensor, logp_GK: Tensor, tail_G: Tensor, *, tables: XTokenTables
) -> tuple[Tensor, Tensor]:
    """(support ids [G, L], log P [G, L + 1]): the teacher top-k projected, plus the rest bucket."""
    g, k = ids_GK.shape
    if bool((ids_GK >= tables.t2s_ids.shape[0]).any()):
        raise ValueError(f"a teacher id is >= the projection's {tables.t2s_ids.shape[0]} rows")
    # empty top-k slots (id -1: fewer finite logits than k) carry no mass; their rows are
    # clamped to 0 only to index the table, and masked out again
    p = torch.where(ids_GK >= 0, logp_GK.float().exp(), 0.0)
    rows = ids_GK.clamp(min=0)
    s_ids = torch.where((ids_GK >= 0)[..., None], tables.t2s_ids[rows], -1)  # [G, K, P]
    w = tables.t2s_weights[rows] * (ids_GK >= 0)[..., None]
    # teacher token j spreads p_j over its projection slots; several teacher tokens may land in
    # the same student bucket, so equal ids of a row are merged into one category (dedup_rows)
    contrib = p[..., None] * w
    uniq, mass = dedup_rows(s_ids.reshape(g, -1), contrib.reshape(g, -1))
    # the rest bucket: the teacher's tail outside its top-k, plus the share of each top-k token
    # that its projection row does not place (rows may sum to < 1)
    rest = tail_G.float().exp() + (p * (1.0 - w.sum(-1))).sum(-1)
    logp = torch.cat([safe_log(mass), safe_log(rest)[:, None]], dim=-1)
    # padding slots of the deduplicated support (id -1) are categories of probability 0
    return uniq, logp.masked_fill(
        torch.cat([uniq < 0, torch.zeros_like(rest, dtype=torch.bool)[:, None]], -1), float("-inf")
    )


def _bucket_logq(lp_at, ids_rL: Tensor, members: tuple[Tensor, Tensor]) -> Tensor:
    """log Q over the support buckets + rest, [r, L + 1].

    ``lp_at(drop_ids) -> (log q at drop_ids, log mass outside them)``. A bucket b holds b itself
    and the few pooled student tokens m with key(m) = b (``members``: ids and keys; a member is
    never a key, so the ids stay distinct). Q(b) = q(b) + its pooled members; Q_rest is the mass
    outside the support ids and their members: exact, no 1 - x.
    """
    member_ids, member_keys = members
    if member_ids.numel() == 0:  # buckets are single tokens
        lp, rest = lp_at(ids_rL)
        return torch.cat([lp, rest[:, None]], -1)
    r, n_slots = ids_rL.shape
    # slot of each pooled member's bucket in this row's support: binary search in the sorted
    # support (empty slots, -1, sort first and never match a key)
    sorted_ids, order = ids_rL.sort(-1)
    keys = member_keys.expand(r, -1).contiguous()
    pos = torch.searchsorted(sorted_ids, keys).clamp(max=n_slots - 1)
    m_in = sorted_ids.gather(1, pos) == keys
    m_slot = order.gather(1, pos)
    lp, rest = lp_at(torch.cat([ids_rL, torch.where(m_in, member_ids.expand(r, -1), -1)], -1))
    pooled = torch.zeros(r, n_slots + 1, dtype=lp.dtype, device=lp.device)
    pooled = pooled.scatter_add(1, torch.where(m_in, m_slot, n_slots), lp[:, n_slots:].exp())
    sup = safe_log(lp[:, :n_slots].exp() + pooled[:, :n_slots])
    return torch.cat([sup, rest[:, None]], -1)


def _xtoken_block(block_cV, local_r, ids_rL, logp_rL1, *, config, vocab_size, members, tp_group):
    """The vocab-parallel composition (with a tp_group); the single-device path is fused."""
    x = take_rows(block_cV, local_r).to(compute_dtype(block_cV))
    x = vocab_ops.mask_padded(x, vocab_size, tp_group=tp_group)
    if config.temperature != 1.0:
        x = x / config.temperature
    logz = vocab_ops.logsumexp(x, tp_group)

    def lp_at(drop):
        lse = vocab_ops.logsumexp_excluding(x, drop, tp_group)
        return vocab_ops.gather(x, drop, tp_group) - logz[:, None], lse - logz

    return divergence_terms(logp_rL1, _bucket_logq(lp_at, ids_rL, members), config)


def xtoken(
    student_logits_BSV: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    *,
    tables: XTokenTables,
    vocab_size: int,
    config: XTokenConfig,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
    cp: CPContext | None = None,
) -> LossOutput:
    """Cross-tokenizer KD over aligned chunks (docs/losses.md, "`xtoken`").

    Under CP (``cp``: logits in the CP layout, index over whole rows) a chunk's terms are
    computed and counted by the rank holding its start row (`context`).
    """
    fields = ("topk_ids", "topk_logprobs", "tail_logprob")
    logits, chunks, metrics = open_chunk_loss(
        "xtoken", student_logits_BSV, teacher, index, cp, fields=fields
    )
    st, te = index.student, index.teacher
    # 1:N, N:1 and N:M chunks: one distribution term each (at their start), + the chain term
    is_multi = (st.count[chunks] > 1) | (te.count[chunks] > 1)
    metrics.update(replicated({"chunks_multi_token": is_multi.sum()}, cp))
    total = zero_sum_like(logits)
    if chunks.numel() == 0:
        return empty_loss(logits, metrics)
    # the start row of a chunk is the position whose distribution predicts its first token
    rows, own = owned_rows(st.start_rows()[chunks], cp)
    mine = chunks[own]
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    metrics["teacher_rest_mass_sum"] = metrics["student_rest_mass_sum"] = zero
    if mine.numel():
        k = teacher.topk_ids.shape[-1]
        tr = te.start_rows()[mine]
        ids_G, logp_G = project_teacher(
            teacher.topk_ids.reshape(-1, k)[tr].long(),
            teacher.topk_logprobs.reshape(-1, k)[tr],
            teacher.tail_logprob.reshape(-1)[tr],
            tables=tables,
        )
        metrics["teacher_rest_mass_sum"] = logp_G[:, -1].exp().sum()
        members = tuple(t.to(logits.device) for t in tables.members())
        if tp_group is None:

            def lp_at(drop):
                lp, rest, _ = logprobs_at_rows(
                    logits,
                    rows,
                    drop,
                    vocab_size=vocab_size,
                    temperature=config.temperature,
                    chunk_size=chunk_size,
                )
                return lp, rest

            terms, q_rest = divergence_terms(logp_G, _bucket_logq(lp_at, ids_G, members), config)
        else:
            fn = partial(
                _xtoken_block,
                config=config,
                vocab_size=vocab_size,
                members=members,
                tp_group=tp_group,
            )
            terms, q_rest = map_rows(fn, logits, rows, ids_G, logp_G, chunk_size=chunk_size)
        total = terms.sum()
        metrics["student_rest_mass_sum"] = q_rest.sum()
    if config.chain_weight > 0:
        teacher.require(("target_logprob",), mode="xtoken")
        if bool(is_multi.any()):  # the same on every CP rank: the index is replicated
            ls, lt = chunk_chains(
                logits,
                teacher,
                index,
                chunks_C=chunks[is_multi],
                vocab_size=vocab_size,
                chunk_size=chunk_size,
                tp_group=tp_group,
                cp=cp,
            )
            chain_C = binary_divergence(lt, ls, kind="kl", temperature=1.0)
            chain = chain_C[own[is_multi]].sum()  # indexed, never skipped (CP all-reduce)
            metrics["chain_sum"] = chain.detach()
            total = total + config.chain_weight * chain
    metrics["kd_sum"] = total.detach()
    return LossOutput(total, as_count(mine.numel(), logits.device), metrics)
