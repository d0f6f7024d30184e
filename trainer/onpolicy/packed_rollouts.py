"""Rollouts packed for the student's forward (``data.packing`` on an on-policy run).

A microbatch's rollouts (prompt + completion: uneven, since completions end at EOS) are packed
into rows of ``row_tokens`` student tokens by the shard side's packer (`pack_documents`:
best-fit over a bounded buffer), with position ids restarting at every rollout, so attention
stays within one (`model_inputs`' packed path: transformers masks by document). Only the
student's forward runs packed: its per-position outputs (the lm_head's input, or whole logits)
are gathered back into the rollouts' own padded rows, where the targets, chunk ids, train
flags, importance weights, the teachers' outputs and every loss already live. So nothing per
rollout is repacked, the teachers score rollouts as before, and no target crosses a rollout.

Legend: B rollouts, T their padded width, R packed rows, P their width, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from tokenbridge.losses.ops.head_logits import HeadLogits
from trainer.data.microbatches import restart_positions
from trainer.data.packing import PackLimits, pack_documents
from trainer.parallel.head import student_logits


@dataclass
class PackedRollouts:
    """A microbatch's rollouts as packed rows, and where each rollout position landed."""

    input_ids_RP: torch.Tensor  # int64, the rollouts of each row in order, pad id after them
    position_ids_RP: torch.Tensor  # int64, restarting at every rollout (and on the padding)
    # int64 [B, T]: the flat index (into R * P) of rollout b's position t; a padding position
    # reads its own rollout's last token, so even a masked read never leaves its rollout
    index_BT: torch.Tensor
    rows: list[list[int]]  # per packed row: its rollouts (indices into the microbatch), in order

    @property
    def positions(self) -> int:
        """The positions the student's forward computes (padding included)."""
        return self.input_ids_RP.numel()

    def inputs(self) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments: no attention mask, so transformers builds the
        block-diagonal causal mask from the restarting position ids."""
        return {"input_ids": self.input_ids_RP, "position_ids": self.position_ids_RP}

    def unpack(self, logits: torch.Tensor | HeadLogits) -> torch.Tensor | HeadLogits:
        """The student's outputs on the packed rows ([R, P, ...]) in the rollouts' layout
        ([B, T, ...]): a gather, whose backward adds each gradient to the position it read."""
        if isinstance(logits, HeadLogits):
            hidden = logits.hidden
            return replace(logits, hidden=hidden.reshape(-1, hidden.shape[-1])[self.index_BT])
        return logits.reshape(-1, logits.shape[-1])[self.index_BT]

    def to(self, device) -> PackedRollouts:
        return PackedRollouts(
            self.input_ids_RP.to(device),
            self.position_ids_RP.to(device),
            self.index_BT.to(device),
            self.rows,
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_rollouts(
    input_ids_BT: torch.Tensor,
    lengths: list[int],
    *,
    row_tokens: int,
    buffer: int,
    pad_id: int,
    pad_to_multiple: int = 8,
) -> PackedRollouts:
    """The rollouts of one microbatch (right-padded rows of ``lengths`` tokens) packed into
    rows of at most ``row_tokens`` (`pack_documents` over a buffer of ``buffer`` rollouts, in
    order), padded to the longest packed row (a multiple of ``pad_to_multiple``).

    Rows are padded to the longest of them, so the fullest rows are not always the fewest
    positions: rollouts of 200, 180, 150 and 120 tokens in rows of 500 make one row of 500 and
    one of 150, 1,008 positions where their padded rows take 800. Of the row limits from the
    longest rollout (one rollout a row at most: never more positions than the padded rows) up
    to ``row_tokens``, the one whose rows compute the fewest positions is taken (the smallest
    of equals)."""
    docs = [(n,) for n in lengths]
    longest = max(lengths)
    step = max(pad_to_multiple, (row_tokens - longest) // 32)
    limits = sorted({*range(longest, row_tokens, step), row_tokens})
    best = None
    for limit in limits:
        rows = pack_documents(docs, PackLimits(limit, ()), buffer=buffer)
        width = _round_up(max(sum(lengths[b] for b in row) for row in rows), pad_to_multiple)
        if best is None or len(rows) * width < len(best[0]) * best[1]:
            best = rows, width
    rows, width = best
    ids = np.full((len(rows), width), pad_id, np.int64)
    pos = np.zeros((len(rows), width), np.int64)
    index = np.zeros(tuple(input_ids_BT.shape), np.int64)
    src = input_ids_BT.cpu().numpy()
    t_B = np.arange(input_ids_BT.shape[1])
    for r, row in enumerate(rows):
        at = 0
        for b in row:
            n = lengths[b]
            ids[r, at : at + n] = src[b, :n]
            index[b] = r * width + at + np.minimum(t_B, n - 1)
            at += n
        pos[r] = restart_positions([lengths[b] for b in row], width)
    device = input_ids_BT.device
    return PackedRollouts(
        torch.from_numpy(ids).to(device),
        torch.from_numpy(pos).to(device),
        torch.from_numpy(index).to(device),
        rows,
    )


def rollout_logits(
    model: torch.nn.Module, batch, *, chunk: int, tp_group=None
) -> torch.Tensor | HeadLogits:
    """The student's logits on a `RolloutBatch` in the rollouts' layout [B, T, V]: one forward
    on its padded rows, or on its packed rows (``batch.packed``) laid back. The whole vocabulary
    under TP (the on-policy losses are not vocab-parallel)."""
    packed = batch.packed
    if packed is None:
        inputs = {"input_ids": batch.input_ids_BT, "attention_mask": batch.attention_mask_BT}
    else:
        inputs = packed.inputs()
    logits = student_logits(model, inputs, chunk=chunk, tp_group=tp_group, gather_vocab=True)
    return logits if packed is None else packed.unpack(logits)
