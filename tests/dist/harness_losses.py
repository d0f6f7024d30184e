"""Small losses written from the distributed ops, for the parallelism-invariance matrix.

Each is `fn(student_local, batch_local, groups) -> (sum, count)`: local shards in, local loss
SUM and token/chunk COUNT out, exactly the contract of tokenbridge/losses (the caller divides by
`global_count`). They exercise every op on the paths a real loss takes: target log-probs, soft
CE + entropy (full-vocab KD), top-k KD with a tail bucket, chunk-level sums across CP borders,
sampling truncation, the on-device CP shift, and the all-to-all sequence-parallel detour.
`batch_local` holds per-token tensors already in this rank's CP layout and TP slice.
Legend: B rows, L local tokens, V local vocab, K teacher top-k, C chunks per row.
"""

from __future__ import annotations

import torch

from tokenbridge.dist_ops import (
    CPContext,
    cp_segment_owner,
    cp_segment_sum,
    cp_shift_next,
    reduce_from_tp,
    vocab_to_seq_parallel,
    vp_entropy,
    vp_soft_ce,
    vp_softmax,
    vp_target_logprobs,
)
from trainer.parallel.mesh import ParallelGroups

CHUNK = 5  # rows per chunk: chunk borders fall inside rows and across CP pieces


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum()


def ce(student_BLV, batch, groups: ParallelGroups):
    mask = batch["targets"] >= 0
    lp = vp_target_logprobs(student_BLV, batch["targets"], groups.tp, chunk_size=CHUNK)
    return -_masked_sum(lp, mask), mask.sum()


def ce_shift_on_device(student_BLV, batch, groups: ParallelGroups):
    """Targets built on the device from the CP-local input ids (crosses CP piece borders)."""
    targets = cp_shift_next(batch["input_ids"], groups.cp, fill=-100)
    targets = torch.where(batch["targets"] >= 0, targets, -100)  # padding mask as in data
    mask = targets >= 0
    lp = vp_target_logprobs(student_BLV, targets, groups.tp, chunk_size=CHUNK)
    return -_masked_sum(lp, mask), mask.sum()


def kd_full_kl(student_BLV, batch, groups: ParallelGroups):
    """Forward KL(p_teacher || q_student) over the full vocabulary, temperature 2."""
    mask = batch["targets"] >= 0
    tau = 2.0
    with torch.no_grad():
        p_BLV = vp_softmax(batch["teacher_logits"], groups.tp, temperature=tau)
        h_BL = vp_entropy(batch["teacher_logits"], groups.tp, temperature=tau)
    ce_BL = vp_soft_ce(student_BLV, p_BLV, groups.tp, temperature=tau, chunk_size=CHUNK)
    return _masked_sum(ce_BL - h_BL, mask) * tau**2, mask.sum()


def _tail(logp_BLK: torch.Tensor) -> torch.Tensor:
    """log(1 - sum_k p_k), clamped away from log 0."""
    return torch.log1p(-logp_BLK.exp().sum(-1).clamp(max=1 - 1e-6))


def kd_topk_tail(student_BLV, batch, groups: ParallelGroups, *, reverse: bool = False):
    """KL over the teacher's top-k + a tail bucket (forward or reverse)."""
    mask = batch["targets"] >= 0
    t_lp = batch["teacher_topk_logprobs"]
    s_lp = vp_target_logprobs(student_BLV, batch["teacher_topk_ids"], groups.tp, chunk_size=CHUNK)
    t_all = torch.cat([t_lp, _tail(t_lp).unsqueeze(-1)], -1)
    s_all = torch.cat([s_lp, _tail(s_lp).unsqueeze(-1)], -1)
    if reverse:
        kl = (s_all.exp() * (s_all - t_all)).sum(-1)
    else:
        kl = (t_all.exp() * (t_all - s_all)).sum(-1)
    return _masked_sum(kl, mask), mask.sum()


def kd_topk_reverse(student_BLV, batch, groups: ParallelGroups):
    return kd_topk_tail(student_BLV, batch, groups, reverse=True)


def chunk_chain(student_BLV, batch, groups: ParallelGroups):
    """ALM-like: per alignment chunk, (student chain log-prob - teacher chain log-prob)^2.

    A chunk's tokens may sit on different CP ranks: local sums, all-reduced [B * C]; each chunk
    is counted by one owner rank.
    """
    targets = batch["targets"]
    lp = vp_target_logprobs(student_BLV, targets, groups.tp, chunk_size=CHUNK)
    lp = torch.where(targets >= 0, lp, torch.zeros_like(lp))
    n_chunks = batch["teacher_chunk_logprobs"].shape[1]
    rows = torch.arange(targets.shape[0]).unsqueeze(1) * n_chunks
    seg = torch.where(batch["chunk_ids"] >= 0, batch["chunk_ids"] + rows, -1)
    n_seg = targets.shape[0] * n_chunks
    sums = cp_segment_sum(lp, seg, n_seg, groups.cp)
    owner = cp_segment_owner(seg, n_seg, groups.cp)
    diff = sums - batch["teacher_chunk_logprobs"].reshape(-1)
    return (diff**2 * owner).sum(), owner.sum()


def chunk_start_and_chain(student_BLV, batch, groups: ParallelGroups):
    """The pattern the chunk modes (xtoken, gold, alm) need under CP, on full-sequence positions.

    Per chunk: a distribution term at the row predicting its first token (full-sequence flat
    row, found on the rank that holds it via `CPContext.local_rows`) weighted by a function of
    the chunk's chain log-prob (a segment sum finished over CP). The chunk is counted by the
    holder of its start row only.
    """
    full_ids = batch["chunk_ids_full"]  # [B, T]: rows only, whole sequence on every rank
    b, seq = full_ids.shape
    cp = CPContext(groups.cp, seq)
    n_chunks = batch["teacher_chunk_logprobs"].shape[1]
    # chain log-probs from the local tokens, finished over CP
    targets = batch["targets"]
    lp_tok = vp_target_logprobs(student_BLV, targets, groups.tp, chunk_size=CHUNK)
    lp_tok = torch.where(targets >= 0, lp_tok, torch.zeros_like(lp_tok))
    rows = torch.arange(b).unsqueeze(1) * n_chunks
    seg = torch.where(batch["chunk_ids"] >= 0, batch["chunk_ids"] + rows, -1)
    chain = cp.segment_sum(lp_tok, seg, b * n_chunks)
    # start row of every chunk: (first token of the chunk) - 1, in full flat positions
    flat_seg = torch.where(full_ids >= 0, full_ids + rows, -1).reshape(-1)
    keep = flat_seg >= 0
    first = torch.full((b * n_chunks,), b * seq, dtype=torch.long)
    first = first.scatter_reduce(0, flat_seg[keep], torch.arange(b * seq)[keep], "amin")
    has_start = (first < b * seq) & (first % seq > 0)
    chunk_ids = has_start.nonzero().squeeze(1)
    local = cp.local_rows(first[chunk_ids] - 1)
    mine = local >= 0
    v_local = student_BLV.shape[-1]
    rows_R = student_BLV.reshape(-1, v_local).index_select(0, local[mine])
    tgt_R = targets.reshape(-1)[local[mine]].clamp(min=0)
    lp_R = vp_target_logprobs(rows_R, tgt_R, groups.tp, temperature=1.3)
    weight_R = torch.nn.functional.softplus(chain[chunk_ids[mine]] + 3.0)
    return -(weight_R * lp_R).sum(), mine.sum()


def sampled_logprobs(student_BLV, batch, groups: ParallelGroups):
    """Policy log-probs under the sampler's distribution (temperature, top-k, top-p)."""
    lp = vp_target_logprobs(
        student_BLV,
        batch["targets"],
        groups.tp,
        temperature=0.9,
        top_k=11,
        top_p=0.8,
        chunk_size=CHUNK,
    )
    mask = (batch["targets"] >= 0) & torch.isfinite(lp)
    return -_masked_sum(lp, mask), mask.sum()


def ce_entropy_bonus(student_BLV, batch, groups: ParallelGroups):
    total, count = ce(student_BLV, batch, groups)
    mask = batch["targets"] >= 0
    ent = vp_entropy(student_BLV, groups.tp, chunk_size=CHUNK)
    return total - 0.1 * _masked_sum(ent, mask), count


def ce_seq_parallel(student_BLV, batch, groups: ParallelGroups):
    """CE after the all-to-all to [rows / TP, V]: plain dense log-softmax on whole rows."""
    v_local = student_BLV.shape[-1]
    rows_NV = vocab_to_seq_parallel(student_BLV.reshape(-1, v_local), groups.tp)
    targets = batch["targets"].reshape(-1)
    n = rows_NV.shape[0]
    mine = targets[groups.tp_rank * n : (groups.tp_rank + 1) * n]
    logp = torch.log_softmax(rows_NV.float(), -1).gather(1, mine.clamp(min=0).unsqueeze(1))
    part = -_masked_sum(logp.squeeze(1), mine >= 0)
    return reduce_from_tp(part, groups.tp), (targets >= 0).sum()


LOSSES = {
    "ce": ce,
    "ce_shift_on_device": ce_shift_on_device,
    "kd_full_kl": kd_full_kl,
    "kd_topk_tail": kd_topk_tail,
    "kd_topk_reverse": kd_topk_reverse,
    "chunk_chain": chunk_chain,
    "chunk_start_and_chain": chunk_start_and_chain,
    "sampled_logprobs": sampled_logprobs,
    "ce_entropy_bonus": ce_entropy_bonus,
    "ce_seq_parallel": ce_seq_parallel,
}
