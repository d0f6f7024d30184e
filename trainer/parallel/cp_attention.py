"""Model-level context parallelism: an attention function registered with transformers.

Under CP each rank runs the model on its positions of every row (the load-balanced layout, with
global position ids). Everything in a decoder layer is per position except attention, so this
function all-gathers K and V over the cp group and masks by global positions; a forward without
the ``cp_attention`` keyword falls back to transformers' SDPA. How, and what it costs:
docs/parallelism.md, "Context parallel".

Legend: B rows, H heads (local under TP), K K/V heads, L = T / CP local positions, T positions,
D head dim, P = T / (2 CP) positions of a piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenbridge.dist_ops.collectives import Group
from tokenbridge.dist_ops.context_parallel import cp_all_gather, cp_piece_bounds, cp_positions

if TYPE_CHECKING:
    from trainer.data.microbatches import StudentRows

CP_ATTENTION = "tokenbridge_cp"


@dataclass(frozen=True)
class CPAttention:
    """This forward's CP layout, passed to every layer as the ``cp_attention`` keyword.

    `positions_L`: the global positions of this rank's tokens (layout order); `allowed_11LT`:
    the causal mask by global positions (True = may attend), shared by every full-attention
    layer; `pieces`: per local piece, its local rows [lo, hi) and the end of the keys it can
    see (its last position + 1).
    """

    group: Group
    seq_len: int
    positions_L: Tensor
    allowed_11LT: Tensor
    pieces: tuple[tuple[int, int, int], ...]
    _masks: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls, group: Group, *, seq_len: int, cp_size: int, cp_rank: int, device
    ) -> CPAttention:
        pos_L = cp_positions(seq_len, cp_size, cp_rank, device=device)
        keys_T = torch.arange(seq_len, device=device)
        allowed_LT = keys_T[None, :] <= pos_L[:, None]
        lo, pieces = 0, []
        for start, end in cp_piece_bounds(seq_len, cp_size, cp_rank):
            pieces.append((lo, lo + end - start, end))
            lo += end - start
        return cls(group, seq_len, pos_L, allowed_LT[None, None], tuple(pieces))

    def mask(self, sliding_window: int | None) -> Tensor:
        """The mask of a layer: causal, and for a sliding-window layer at most `sliding_window`
        positions back."""
        if not sliding_window:
            return self.allowed_11LT
        keys_T = torch.arange(self.seq_len, device=self.positions_L.device)
        near_LT = self.positions_L[:, None] - keys_T[None, :] < sliding_window
        return self.allowed_11LT & near_LT[None, None]

    def piece_masks(self, dtype: torch.dtype, sliding_window: int | None) -> list[Tensor]:
        """Additive masks (0 / -inf) [1, 1, P, keys seen] per local piece, made once per forward,
        dtype and window, shared by the layers. Why not the boolean mask: SDPA converts it to
        such a tensor on every call and keeps that copy for backward, one per layer (64 MiB a
        layer at 8k tokens)."""
        key = (dtype, sliding_window)
        if key not in self._masks:
            allowed_11LT = self.mask(sliding_window)
            masks = []
            for lo, hi, k_end in self.pieces:
                seen_11PT = allowed_11LT[:, :, lo:hi, :k_end]
                zeros = torch.zeros(seen_11PT.shape, dtype=dtype, device=seen_11PT.device)
                masks.append(zeros.masked_fill_(~seen_11PT, float("-inf")))
            self._masks[key] = masks
        return self._masks[key]


def _repeat_kv(x_BKTD: Tensor, n_rep: int) -> Tensor:
    """Grouped-query attention: each K/V head serves `n_rep` query heads."""
    if n_rep == 1:
        return x_BKTD
    b, k, t, d = x_BKTD.shape
    return x_BKTD[:, :, None].expand(b, k, n_rep, t, d).reshape(b, k * n_rep, t, d)


def cp_attention_forward(
    module: torch.nn.Module,
    query_BHLD: Tensor,
    key_BKLD: Tensor,
    value_BKLD: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cp_attention: CPAttention | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature; returns ([B, L, H, D], None)."""
    if cp_attention is None:  # a whole-sequence forward: exactly transformers' SDPA path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if sliding_window is not None:
            kwargs["sliding_window"] = sliding_window
        return sdpa_attention_forward(
            module,
            query_BHLD,
            key_BKLD,
            value_BKLD,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("context-parallel attention (SDPA) has no attention-logit softcapping")
    cp = cp_attention
    # natural order, [B, K, T, D]; the backward is a reduce-scatter, the sum of every rank's
    # gradient for this rank's keys, because the objective sums the ranks' terms
    key_BKTD = cp_all_gather(key_BKLD, cp.group, dim=2)
    value_BKTD = cp_all_gather(value_BKLD, cp.group, dim=2)
    n_rep = query_BHLD.shape[1] // key_BKTD.shape[1]
    key_BHTD, value_BHTD = _repeat_kv(key_BKTD, n_rep), _repeat_kv(value_BKTD, n_rep)
    masks = cp.piece_masks(query_BHLD.dtype, sliding_window)
    outs = []
    for (lo, hi, k_end), mask_11PT in zip(cp.pieces, masks):
        # a piece sees no key past its own end: those keys are not computed at all. Piece j of
        # P positions costs P (j + 1) P, so each rank does (2 CP + 1) P^2 of the (2 CP)^2 P^2 / 2
        # causal work: balanced, without the masked-out half one [L, T] call would compute
        outs.append(
            F.scaled_dot_product_attention(
                query_BHLD[:, :, lo:hi],
                key_BHTD[:, :, :k_end],
                value_BHTD[:, :, :k_end],
                attn_mask=mask_11PT,
                dropout_p=dropout,
                scale=scaling,
            )
        )
    out_BHLD = torch.cat(outs, dim=2)
    return out_BHLD.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register `cp_attention_forward` (and, for its whole-sequence fallback, SDPA's masks)
    under `CP_ATTENTION`; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention_forward)
    AttentionMaskInterface.register(CP_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def model_inputs(rows: StudentRows, *, group: Group) -> dict:
    """Keyword arguments of the model's forward for this rank's share of a microbatch
    (`Microbatch.student_rows`), `group` its cp group.

    cp = 1: ids and the padding mask, exactly as an unsharded forward (packed rows: ids and
    position ids restarting per document). cp > 1: the local ids,
    their global position ids, and the CP mask passed as a 4-D ``attention_mask``
    (transformers passes a 4-D mask through untouched, so no [L, L] mask is built for nothing)
    plus the ``cp_attention`` keyword, which reaches every attention call.
    """
    if rows.cp_size == 1 and rows.position_ids_BL is not None:
        # packed rows: position ids restart at every document and no 2-D mask is passed, so
        # transformers builds the block-diagonal causal mask from them (masking_utils'
        # packed-sequence detection; flash-attention's varlen path on CUDA). Right padding is
        # a block of its own after the last document. The detection needs a forward without
        # a KV cache (transformers skips it when one exists, and builds one by default in eval
        # mode): `student_logits` passes use_cache=False.
        return {"input_ids": rows.input_ids_BL, "position_ids": rows.position_ids_BL}
    if rows.cp_size == 1:
        return {"input_ids": rows.input_ids_BL, "attention_mask": rows.attention_mask_BL}
    cp = CPAttention.build(
        group,
        seq_len=rows.seq_len,
        cp_size=rows.cp_size,
        cp_rank=rows.cp_rank,
        device=rows.input_ids_BL.device,
    )
    # no key padding mask: rows are right-padded and causal, so a real position never sees a pad
    return {
        "input_ids": rows.input_ids_BL,
        "position_ids": rows.position_ids_BL,
        "attention_mask": cp.allowed_11LT,
        "cp_attention": cp,
    }
