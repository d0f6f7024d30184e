"""Conversations in the losses: the train mask on chunks, and the end-of-turn term.

A chunk is trained when every student token of it is a target; trained text chunks get the
mode's own loss, trained turn-marker chunks (each model's own control tokens, which no
projection compares) the end-of-turn term `eot`, a binarised KL of the two "stop here"
probabilities. Rules and formula: docs/losses.md, "Conversations".

Legend: B rows, S student positions, U teacher positions, V student width, G chunks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tokenbridge.formats.shard_schema import CHUNK_OPEN
from tokenbridge.losses.alm import owned_chain_terms
from tokenbridge.losses.base import LossOutput, as_count, empty_loss
from tokenbridge.losses.ops.cp_chunks import complete_chunks, open_chunk_loss
from tokenbridge.losses.ops.rowwise import DEFAULT_CHUNK
from tokenbridge.losses.ops.segments import ChunkIndex
from tokenbridge.teacher.outputs import TeacherOutputs

if TYPE_CHECKING:
    from tokenbridge.dist_ops import CPContext

EOT_EPS = 1e-6


def trained_chunks(index: ChunkIndex, targets_BS: Tensor) -> Tensor:
    """[G] bool: every student token of the chunk is a target (its predicting position keeps
    a target in ``targets_BS``, the masked targets of the batch)."""
    st = index.student
    kept = targets_BS.reshape(-1) >= 0
    hit = st.target_chunk[kept & (st.target_chunk >= 0)]
    n_targets = torch.bincount(hit, minlength=index.n_chunks)
    return (st.count > 0) & (n_targets == st.count)


@dataclass(frozen=True)
class ChunkSplit:
    """The trained chunks of a batch, as two views of one `ChunkIndex`: ``text`` for the mode's
    loss and ``turns`` (turn-marker pairs, None for shards without chunk kinds) for `eot`."""

    text: ChunkIndex
    turns: ChunkIndex | None

    def count(self) -> int:
        """Terms the mode + `eot` will count (known before any forward)."""
        n = int(complete_chunks(self.text)[0].numel())
        return n + (0 if self.turns is None else int(complete_chunks(self.turns)[0].numel()))

    def teacher_positions(self) -> Tensor:
        """[B, U] bool: teacher positions whose outputs the losses read (each predicts a token
        of a counted chunk: start rows, last rows, chain rows)."""
        te = self.text.teacher
        used = torch.zeros(self.text.n_chunks + 1, dtype=torch.bool, device=te.target_chunk.device)
        for index in (self.text, self.turns):
            if index is not None:
                used[complete_chunks(index)[0]] = True
        rows = used[torch.where(te.target_chunk >= 0, te.target_chunk, self.text.n_chunks)]
        return rows.reshape(-1, te.width)


def split_chunks(index: ChunkIndex, targets_BS: Tensor) -> ChunkSplit:
    """The text and turn-marker views of `index` under the batch's train mask: trained
    text chunks and trained turn-marker pairs (`CHUNK_EOT`, and `CHUNK_OPEN` in train mode ``all``)."""
    trained = trained_chunks(index, targets_BS)
    if index.kind is None:
        return ChunkSplit(dataclasses.replace(index, select=trained), None)
    marker = index.kind >= CHUNK_OPEN
    return ChunkSplit(
        dataclasses.replace(index, select=trained & ~marker),
        dataclasses.replace(index, select=trained & marker),
    )


def eot(
    student_logits_BSV: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    *,
    vocab_size: int,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
    cp: CPContext | None = None,
) -> LossOutput:
    """The end-of-turn term over the selected turn-marker chunks of `index`
    (docs/losses.md, "Conversations").

    sum = sum of KL(Bern(p_t) || Bern(p_s)) over the pairs; count = pairs. Under CP a pair's
    term belongs to the rank holding its start row, as in `alm`."""
    # the dropped-chunk counts are the text view's to report (they would be counted twice)
    logits, chunks, _ = open_chunk_loss(
        "eot", student_logits_BSV, teacher, index, cp, fields=("target_logprob",)
    )
    if chunks.numel() == 0:
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        return empty_loss(logits, {"eot_sum": zero, "eot_terms_sum": zero})
    terms, own, _, _ = owned_chain_terms(
        logits,
        teacher,
        index,
        chunks,
        kind="kl",
        temperature=1.0,
        eps=EOT_EPS,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        tp_group=tp_group,
        cp=cp,
    )
    total = terms[own].sum()  # indexed, never skipped: keeps the CP all-reduce in the graph
    n = own.sum()
    metrics = {"eot_sum": total.detach(), "eot_terms_sum": n.to(total.dtype)}
    return LossOutput(total, as_count(n, logits.device), metrics)


def with_turns(text: LossOutput, turns: LossOutput | None) -> LossOutput:
    """A chunk mode's output plus the end-of-turn term's: sums and counts add, metrics merge."""
    if turns is None:
        return text
    return LossOutput(
        text.sum + turns.sum, text.count + turns.count, {**text.metrics, **turns.metrics}
    )
