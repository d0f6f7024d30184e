"""Rollouts -> what the student's forward, each teacher and each loss read.

A microbatch of rollouts carries, per teacher, an `AlignedBatch` with chunk ids on completion
tokens only, so every loss mode applies to rollouts as it does to shard rows: a teacher with
the student's tokenizer reads the sampled ids themselves (one chunk per token), any other its
own tokens of the same bytes, aligned on the fly (`trainer.onpolicy.realign`).

Legend: B rollouts, T student positions, U teacher positions, K top-k support.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenbridge.losses.ops.segments import AlignedBatch
from tokenbridge.tokenizers import Tokenizer
from trainer.data.microbatches import IGNORE
from trainer.onpolicy.packed_rollouts import PackedRollouts
from trainer.onpolicy.realign import TeacherView, align_rollout
from trainer.onpolicy.sampling.sampler import Rollouts


@dataclass
class RolloutBatch:
    """A microbatch of rollouts: prompt + sampled completion, right-padded, and per teacher
    what it reads. ``targets_BT`` is -1 on the prompt (context, never a target), so the
    position masks of the same-tokenizer modes cover the completion only; with top-k OPD a
    same-tokenizer teacher's input carries the sampling policy's top-k ids (``col_ids``) at
    every position that predicts a completion token, -1 elsewhere: the support it scores."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    targets_BT: torch.Tensor  # the sampled token at each position predicting one, else -1
    aligned: list[AlignedBatch]  # per teacher
    teacher_inputs: list[dict[str, torch.Tensor]]  # per teacher: its channel's inputs
    drops: list[Counter] = field(default_factory=list)  # per teacher: reason -> rollouts
    chunk_drops: list[Counter] = field(default_factory=list)  # per teacher: boundary, invalid
    rollouts: int = 0
    # log-probability of each target under the distribution it was drawn from, where that is
    # not the trained one (`trainer.onpolicy.importance`); None when the sampler used the model
    behaviour_BT: torch.Tensor | None = None
    # data.packing: the rollouts packed for the student's forward (`packed_rollouts`); None:
    # the student runs on the padded rows above
    packed: PackedRollouts | None = None

    def to(self, device) -> RolloutBatch:
        def mv(a: AlignedBatch) -> AlignedBatch:
            return AlignedBatch(
                **{k: None if v is None else v.to(device) for k, v in a.__dict__.items()}
            )

        return RolloutBatch(
            self.input_ids_BT.to(device),
            self.attention_mask_BT.to(device),
            self.targets_BT.to(device),
            [mv(a) for a in self.aligned],
            [{k: v.to(device) for k, v in t.items()} for t in self.teacher_inputs],
            self.drops,
            self.chunk_drops,
            self.rollouts,
            None if self.behaviour_BT is None else self.behaviour_BT.to(device),
            None if self.packed is None else self.packed.to(device),
        )


def completion_rows(aligned: AlignedBatch, width: int) -> torch.Tensor:
    """bool [B, width]: the teacher positions that predict a completion token (the next
    position carries a chunk id), a superset of what the agreement eval scores."""
    chunk_BU = aligned.teacher_chunk
    rows = torch.zeros(chunk_BU.shape[0], width, dtype=torch.bool, device=chunk_BU.device)
    n = min(width, chunk_BU.shape[1])
    rows[:, : n - 1] = chunk_BU[:, 1:n] >= 0
    return rows


def _pad(rows: list[np.ndarray], width: int, fill: int) -> torch.Tensor:
    out = np.full((len(rows), width), fill, np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _same_tokenizer(seqs, n_prompt, *, topk, want_cols, width):
    """Chunks and inputs of a same-tokenizer teacher: one chunk per completion token."""
    chunks, cols = [], []
    for s, p in zip(seqs, n_prompt):
        c = np.full(len(s), -1, np.int64)
        c[p:] = np.arange(len(s) - p)
        chunks.append(c)
    if want_cols:
        k = topk[0].shape[1] if topk else 0
        col = np.full((len(seqs), width, k), -1, np.int32)
        for b, (s, p) in enumerate(zip(seqs, n_prompt)):
            # position i predicts token i + 1: completion token j is predicted at p + j - 1
            col[b, p - 1 : len(s) - 1] = topk[b]
        cols = torch.from_numpy(col)
    return chunks, cols


def build_batch(
    rollouts: Rollouts,
    rows: list[int],
    *,
    student: Tokenizer,
    teachers: list[TeacherView | None],
    want_cols: list[bool],
    pad_id: int,
    pad_to_multiple: int = 8,
) -> RolloutBatch:
    """The microbatch of rollouts ``rows`` (indices into ``rollouts``). ``teachers[i]`` is None
    for a teacher with the student's tokenizer; ``want_cols[i]``: it scores the policy's top-k."""
    seqs = [np.asarray(rollouts.prompts[r] + rollouts.completions[r], np.int64) for r in rows]
    n_prompt = [len(rollouts.prompts[r]) for r in rows]
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    width = _round_up(int(lens.max()), pad_to_multiple)
    ids = _pad(seqs, width, pad_id)
    mask = (torch.arange(width)[None, :] < lens[:, None]).long()
    targets = torch.full_like(ids, IGNORE)
    for b, (s, p) in enumerate(zip(seqs, n_prompt)):
        targets[b, p - 1 : len(s) - 1] = torch.from_numpy(s[p:])
    batch = RolloutBatch(ids, mask, targets, [], [], rollouts=len(rows))
    if rollouts.logprobs is not None:
        batch.behaviour_BT = torch.zeros(ids.shape, dtype=torch.float32)
        for b, (s, p, r) in enumerate(zip(seqs, n_prompt, rows)):
            batch.behaviour_BT[b, p - 1 : len(s) - 1] = torch.from_numpy(rollouts.logprobs[r])
    topk = [rollouts.topk_ids[r] for r in rows] if rollouts.topk_ids is not None else None
    for view, cols_wanted in zip(teachers, want_cols):
        drops, chunk_drops = Counter(), Counter()
        if view is None:
            chunks, cols = _same_tokenizer(
                seqs, n_prompt, topk=topk, want_cols=cols_wanted, width=width
            )
            t_rows, t_chunks = seqs, chunks
            n_chunks = [len(s) - p for s, p in zip(seqs, n_prompt)]
        else:
            chunks, t_rows, t_chunks, n_chunks = [], [], [], []
            for r in rows:
                ra = align_rollout(
                    rollouts.prompts[r],
                    rollouts.completions[r],
                    stopped=rollouts.stopped[r],
                    student=student,
                    view=view,
                    messages=rollouts.meta[r].get("messages") if rollouts.meta else None,
                )
                if ra.dropped is not None:
                    drops[ra.dropped] += 1
                    n = len(rollouts.prompts[r]) + len(rollouts.completions[r])
                    chunks.append(np.full(n, -1, np.int64))
                    bos = view.tokenizer.bos_id
                    t_rows.append(np.asarray([bos if bos is not None else 0], np.int64))
                    t_chunks.append(np.full(1, -1, np.int64))
                    n_chunks.append(0)
                    continue
                chunk_drops["boundary"] += ra.boundary_chunks
                chunk_drops["invalid_utf8"] += ra.invalid_chunks
                chunks.append(ra.student_chunk)
                t_rows.append(ra.teacher_ids)
                t_chunks.append(ra.teacher_chunk)
                n_chunks.append(ra.n_chunks)
            cols = None
        t_lens = torch.tensor([len(t) for t in t_rows], dtype=torch.int64)
        t_width = width if view is None else _round_up(int(t_lens.max()), pad_to_multiple)
        t_pad = pad_id if view is None else _teacher_pad(view.tokenizer)
        t_ids = _pad(t_rows, t_width, t_pad)
        batch.aligned.append(
            AlignedBatch(
                student_ids=ids,
                student_len=lens,
                student_chunk=_pad(chunks, width, -1),
                teacher_ids=t_ids,
                teacher_len=t_lens,
                teacher_chunk=_pad(t_chunks, t_width, -1),
                n_chunks=torch.tensor(n_chunks, dtype=torch.int64),
            )
        )
        inputs = {
            "input_ids": t_ids,
            "attention_mask": (torch.arange(t_width)[None, :] < t_lens[:, None]).long(),
        }
        if cols_wanted:
            inputs["col_ids"] = cols
        batch.teacher_inputs.append(inputs)
        batch.drops.append(drops)
        batch.chunk_drops.append(chunk_drops)
    return batch


def _teacher_pad(tok: Tokenizer) -> int:
    for v in (tok.pad_id, tok.eos_id, 0):
        if v is not None:
            return int(v)
    return 0
