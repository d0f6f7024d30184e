"""Packed sequences (cu_seqlens): next-token log-probs per packed sequence, TP- and CP-aware.

S sequences packed end to end into one stream ("THD"), each padded to a multiple of 2 * CP and
split on its own into 2 * CP pieces (Transformer Engine's THD + CP layout); a target is never
taken from the following sequence, and each sequence's sum is counted on one CP rank.

Legend: T packed stream length (padded), L = T / CP local tokens, S sequences, V local vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenbridge.dist_ops.collectives import Group, group_rank, group_size
from tokenbridge.dist_ops.context_parallel import cp_segment_owner, cp_segment_sum
from tokenbridge.dist_ops.vocab_parallel import vp_target_logprobs

IGNORE = -100


def _check_cu(cu: torch.Tensor, name: str) -> torch.Tensor:
    cu = cu.detach().to("cpu", torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be a nondecreasing 1-d [S + 1] tensor from 0, got {cu}")
    return cu


def packed_sequence_ids(cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """int64 [T]: index of the packed sequence each stream position belongs to."""
    cu = _check_cu(cu_seqlens_padded, "cu_seqlens_padded")
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def packed_cp_positions(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Global stream positions of this CP rank's tokens (int64 [T / CP]), per sequence 2 pieces."""
    cu = _check_cu(cu_seqlens_padded, "cu_seqlens_padded")
    if cp_size == 1:
        return torch.arange(int(cu[-1]))
    parts = []
    for s in range(cu.numel() - 1):
        start, length = int(cu[s]), int(cu[s + 1] - cu[s])
        if length % (2 * cp_size):
            raise ValueError(
                f"sequence {s} has padded length {length}, not a multiple of 2 * CP = "
                f"{2 * cp_size}: pad each sequence (cu_seqlens_padded)"
            )
        piece = length // (2 * cp_size)
        for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + j * piece, start + (j + 1) * piece))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def packed_next_token_targets(
    ids_T: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    ignore: int = IGNORE,
) -> torch.Tensor:
    """targets[t] = ids[t + 1] inside one sequence's real tokens, `ignore` elsewhere."""
    cu = _check_cu(cu_seqlens, "cu_seqlens")
    cu_pad = cu if cu_seqlens_padded is None else _check_cu(cu_seqlens_padded, "cu_seqlens_padded")
    if cu_pad.shape != cu.shape or bool(((cu_pad[1:] - cu_pad[:-1]) < (cu[1:] - cu[:-1])).any()):
        raise ValueError("cu_seqlens_padded must have one entry per sequence and lengths >= real")
    if ids_T.shape != (int(cu_pad[-1]),):
        raise ValueError(f"ids must be [T={int(cu_pad[-1])}] (padded stream), got {ids_T.shape}")
    targets = torch.full_like(ids_T, ignore)
    for s in range(cu.numel() - 1):
        start, real = int(cu_pad[s]), int(cu[s + 1] - cu[s])
        if real > 1:
            targets[start : start + real - 1] = ids_T[start + 1 : start + real]
    return targets


@dataclass(frozen=True)
class PackedLogProbs:
    token_logprobs: torch.Tensor  # fp32 [L], 0 where masked, differentiable
    mask: torch.Tensor  # bool [L], token has a target
    seq_sums: torch.Tensor  # fp32 [S], sum over the whole sequence (all CP ranks)
    seq_owner: torch.Tensor  # bool [S], this CP rank counts the sequence
    positions: torch.Tensor  # int64 [L], stream positions of the local tokens


def packed_logprobs(
    logits: torch.Tensor,
    ids_T: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    tp_group: Group,
    cp_group: Group,
    cu_seqlens_padded: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> PackedLogProbs:
    """Next-token log-probs of a packed stream from this rank's logits [L, V_local].

    ids_T is the whole padded stream (every rank has it; it is small). The logits are this
    rank's CP tokens (`packed_cp_positions` order) and TP vocab shard. ``cu_seqlens`` [S + 1]
    are the cumulative REAL lengths, ``cu_seqlens_padded`` the cumulative lengths after padding
    every sequence to a multiple of 2 * CP (default: ``cu_seqlens``); padding gets no target.
    """
    cu_pad = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    pos_L = packed_cp_positions(cu_pad, group_size(cp_group), group_rank(cp_group))
    if logits.shape[0] != pos_L.numel():
        raise ValueError(f"logits hold {logits.shape[0]} tokens; this CP rank owns {pos_L.numel()}")
    pos_L = pos_L.to(logits.device)
    targets_L = packed_next_token_targets(ids_T, cu_seqlens, cu_pad)[pos_L.to(ids_T.device)]
    targets_L = targets_L.to(logits.device)
    mask_L = targets_L != IGNORE
    lp_L = vp_target_logprobs(
        logits, targets_L, tp_group, temperature=temperature, chunk_size=chunk_size
    )
    lp_L = torch.where(mask_L, lp_L, torch.zeros_like(lp_L))
    seq_L = packed_sequence_ids(cu_pad).to(logits.device)[pos_L]
    n_seq = cu_pad.numel() - 1
    seq_sums = cp_segment_sum(lp_L, seq_L, n_seq, cp_group)
    owner = cp_segment_owner(seq_L, n_seq, cp_group)
    return PackedLogProbs(lp_L, mask_L, seq_sums, owner, pos_L)
