"""Aligned shard rows -> padded microbatches, per data-parallel rank.

The rows come from `trainer.data.shard_reader`'s stream; this module pads them and keeps the
stream's position for checkpoints. A microbatch stays whole under context parallelism (the
teachers read whole rows, and the chunk index is built from them); `Microbatch.student_rows`
gives one CP rank its share.

Legend: B rows in the microbatch, T student positions, U teacher positions, L = T / CP positions
on one context-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from tokenbridge.dist_ops.context_parallel import cp_positions, to_cp_layout
from tokenbridge.formats import shard_schema
from tokenbridge.losses.ops.segments import AlignedBatch
from trainer.data.shard_reader import ShardStream

IGNORE = -1  # target id of positions that are not trained on (as tokenbridge.losses expects)


@dataclass
class StudentRows:
    """The student's share of a microbatch on one context-parallel rank (all of it at cp = 1).

    Targets are shifted on the whole row first, then laid out, so no position needs another
    rank's token. ``position_ids_BL`` is None at cp = 1 (the model's own 0..T-1), except on
    packed rows (restarting at every document).
    """

    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor
    targets_BL: torch.Tensor
    position_ids_BL: torch.Tensor | None
    seq_len: int  # T, the whole (padded) row length
    cp_size: int = 1
    cp_rank: int = 0


@dataclass
class Microbatch:
    """One padded microbatch: the student's tokens and, per teacher, its aligned batch (whose
    student side is these same tensors). Chunk columns are -1 on padding, as on specials."""

    input_ids_BT: torch.Tensor  # int64, student ids, pad id after each row's end
    attention_mask_BT: torch.Tensor  # int64, 1 on real tokens
    targets_BT: torch.Tensor  # int64, the token each position predicts, IGNORE where none
    aligned: list[AlignedBatch] = field(default_factory=list)  # per teacher
    texts: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # global row indices (provenance)
    # conversation shards: the student's train codes (tokenbridge.formats.shard_schema.TRAIN_*), 0 on padding
    train_BT: torch.Tensor | None = None
    # packed rows (`trainer.data.packing`): position ids restarting at every document, the
    # student's and each teacher's; None when rows are not packed (the model's own 0..T-1)
    position_ids_BT: torch.Tensor | None = None
    teacher_position_ids: list[torch.Tensor] = field(default_factory=list)

    @property
    def packed(self) -> bool:
        return self.position_ids_BT is not None

    @property
    def num_targets(self) -> int:
        return int((self.targets_BT != IGNORE).sum())

    def student_rows(self, *, cp_size: int = 1, cp_rank: int = 0) -> StudentRows:
        """This CP rank's positions of every row (`StudentRows`); the same tensors at cp = 1."""
        seq_len = self.input_ids_BT.shape[1]
        if cp_size == 1:
            return StudentRows(
                self.input_ids_BT,
                self.attention_mask_BT,
                self.targets_BT,
                self.position_ids_BT,
                seq_len,
            )
        if self.packed:
            raise ValueError("packed rows under context parallelism (parallel.cp > 1)")
        pos_L = cp_positions(seq_len, cp_size, cp_rank, device=self.input_ids_BT.device)

        def local(x_BT: torch.Tensor) -> torch.Tensor:
            return to_cp_layout(x_BT, cp_size=cp_size, cp_rank=cp_rank, dim=1)

        return StudentRows(
            local(self.input_ids_BT),
            local(self.attention_mask_BT),
            local(self.targets_BT),
            pos_L.expand(self.input_ids_BT.shape[0], -1),
            seq_len,
            cp_size,
            cp_rank,
        )

    def teacher_inputs(self, i: int) -> dict[str, torch.Tensor]:
        """What teacher i's forward reads: its ids and attention mask [B, U]."""
        a = self.aligned[i]
        pos_U = torch.arange(a.teacher_ids.shape[1], device=a.teacher_ids.device)
        mask_BU = (pos_U[None, :] < a.teacher_len[:, None]).long()
        if self.packed:  # the teacher's forward masks by document from these (its own lengths)
            return {
                "input_ids": a.teacher_ids,
                "attention_mask": mask_BU,
                "position_ids": self.teacher_position_ids[i],
            }
        return {"input_ids": a.teacher_ids, "attention_mask": mask_BU}

    def to(self, device: torch.device) -> Microbatch:
        def mv(a: AlignedBatch) -> AlignedBatch:
            moved = {f.name: getattr(a, f.name) for f in fields(a)}
            return AlignedBatch(**{k: v if v is None else v.to(device) for k, v in moved.items()})

        return Microbatch(
            self.input_ids_BT.to(device),
            self.attention_mask_BT.to(device),
            self.targets_BT.to(device),
            [mv(a) for a in self.aligned],
            self.texts,
            self.rows,
            None if self.train_BT is None else self.train_BT.to(device),
            None if self.position_ids_BT is None else self.position_ids_BT.to(device),
            [p.to(device) for p in self.teacher_position_ids],
        )


EVAL_SPLITS = ("window", "document")


def _pad_rows(rows: list[np.ndarray], length: int, pad: int) -> torch.Tensor:
    out = np.full((len(rows), length), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def restart_positions(doc_lens: list[int], width: int) -> np.ndarray:
    """[width] position ids restarting at 0 at every document of a packed row; the padding
    after the last one restarts too (its own block, which causal attention keeps out of every
    real position)."""
    out = np.empty(width, dtype=np.int64)
    at = 0
    for n in [*doc_lens, width - sum(doc_lens)]:
        out[at : at + n] = np.arange(n)
        at += n
    return out


def _positions(doc_lens: list[list[int]], width: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([restart_positions(d, width) for d in doc_lens]))


def train_targets(targets_BT: torch.Tensor, train_BT: torch.Tensor) -> torch.Tensor:
    """The target mask of conversation rows: position t keeps its target only if token t + 1
    is trained (train code > 0), else IGNORE. CE and every KD mode follow the targets."""
    trained_next = torch.zeros_like(train_BT, dtype=torch.bool)
    trained_next[:, :-1] = train_BT[:, 1:] > 0
    return torch.where(trained_next, targets_BT, IGNORE)


def chunk_kinds(teachers: list[dict]) -> torch.Tensor:
    """[B, max n_chunks] chunk kinds of one teacher's rows, -1 past a row's chunks."""
    width = max([int(x["n_chunks"]) for x in teachers] + [1])
    out = np.full((len(teachers), width), -1, dtype=np.int64)
    for b, x in enumerate(teachers):
        kinds = x["chunk_kind"]
        if len(kinds) != int(x["n_chunks"]):
            raise ValueError(f"row {b}: {len(kinds)} chunk kinds for {x['n_chunks']} chunks")
        out[b, : len(kinds)] = kinds
    return torch.from_numpy(out)


def collate(
    rows: list[dict],
    *,
    student_pad: int,
    teacher_pads: list[int],
    pad_to_multiple: int = 8,
    row_ids: list[int] | None = None,
) -> Microbatch:
    """Pad rows (from `ShardReader.row`) into one microbatch; each teacher's tensors are padded
    to its own length U, chunk columns with -1. Packed rows (`trainer.data.packing.pack_row`,
    with ``doc_lens``) get position ids restarting per document on every side, and no target
    across a document boundary (the last token of each document predicts nothing)."""
    lens = [len(r["student_ids"]) for r in rows]
    T = _round_up(max(lens), pad_to_multiple)
    ids = _pad_rows([r["student_ids"] for r in rows], T, student_pad)
    len_B = torch.tensor(lens, dtype=torch.int64)
    pos_T = torch.arange(T)
    mask = (pos_T[None, :] < len_B[:, None]).long()
    # position t predicts token t + 1 of its row; none past the row's last token
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = ids[:, 1:]
    targets[pos_T[None, :] + 1 >= len_B[:, None]] = IGNORE
    packed = "doc_lens" in rows[0]
    position_ids = _positions([r["doc_lens"] for r in rows], T) if packed else None
    if packed:  # position t + 1 starts a document: t is the last of its own
        targets[:, :-1][position_ids[:, 1:] == 0] = IGNORE
    train = None
    # conversation rows: train only on the flagged tokens; text shards (schema version 1) have
    # no train codes and train on every target
    if "train" in rows[0]:
        train = _pad_rows([r["train"] for r in rows], T, shard_schema.TRAIN_NONE)
        targets = train_targets(targets, train)
    mb = Microbatch(
        ids,
        mask,
        targets,
        texts=[r["text"] for r in rows],
        rows=row_ids or [],
        train_BT=train,
        position_ids_BT=position_ids,
    )
    for k, pad in enumerate(teacher_pads):
        tr = [r["teachers"][k] for r in rows]
        for x, n in zip(tr, lens):
            if len(x["student_chunk"]) != n or len(x["chunk"]) != len(x["ids"]):
                raise ValueError(f"teacher {k}: a chunk column's length differs from its ids")
        tlens = [len(x["ids"]) for x in tr]
        U = _round_up(max(tlens), pad_to_multiple)
        if packed:
            mb.teacher_position_ids.append(_positions([x["doc_lens"] for x in tr], U))
        mb.aligned.append(
            AlignedBatch(
                student_ids=ids,
                student_len=len_B,
                student_chunk=_pad_rows([x["student_chunk"] for x in tr], T, -1),
                teacher_ids=_pad_rows([x["ids"] for x in tr], U, pad),
                teacher_len=torch.tensor(tlens, dtype=torch.int64),
                teacher_chunk=_pad_rows([x["chunk"] for x in tr], U, -1),
                n_chunks=torch.tensor([x["n_chunks"] for x in tr], dtype=torch.int64),
                chunk_kind=chunk_kinds(tr) if "chunk_kind" in tr[0] else None,
            )
        )
    return mb


class MicrobatchLoader:
    """Microbatches of `micro_batch_size` rows from a `ShardStream` (stateful, checkpointable)."""

    def __init__(
        self,
        stream: ShardStream,
        *,
        micro_batch_size: int,
        student_pad: int,
        teacher_pads: list[int],
        pad_to_multiple: int,
    ):
        self.stream = stream
        self.micro_batch_size = micro_batch_size
        self.student_pad = student_pad
        self.teacher_pads = teacher_pads
        self.pad_to_multiple = pad_to_multiple

    def __iter__(self) -> MicrobatchLoader:
        return self

    def __next__(self) -> Microbatch:
        ids = [self.stream.next_row() for _ in range(self.micro_batch_size)]
        rows = [self.stream.reader.row(i) for i in ids]
        return collate(
            rows,
            student_pad=self.student_pad,
            teacher_pads=self.teacher_pads,
            pad_to_multiple=self.pad_to_multiple,
            row_ids=ids,
        )

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def eval_texts(self, limit: int) -> list[str]:
        """The first `limit` held-out window texts (the same on every rank)."""
        return [self.stream.reader.text(int(i)) for i in self.stream.eval_rows[:limit]]

    def eval_rows(self, limit: int) -> list[dict]:
        """The first `limit` held-out rows, whole (`ShardReader.row`; conversations)."""
        return [self.stream.reader.row(int(i)) for i in self.stream.eval_rows[:limit]]

    def state_dict(self) -> dict:
        # plain values (a checkpoint stores them as JSON: trainer.checkpoint.state_split)
        return {"position": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["position"])

    def reshard(self, saved: list[dict]) -> str | None:
        """Continue from every dp rank's position of another layout (`ShardStream.reshard`)."""
        return self.stream.reshard(saved)


def pad_id(tokenizer) -> int:
    """The id padding positions carry (masked everywhere; only needs to be a valid row)."""
    for v in (tokenizer.pad_id, tokenizer.eos_id, 0):
        if v is not None:
            return int(v)
    return 0
