"""The chunk modes: one term per aligned chunk of two tokenizations (`xtoken`, `gold`, `alm`).

`ChunkMode` keeps the chunks both sides present, predicted and trained, and prepares a
`turns.ChunkSplit`: the mode's own loss on the text chunks plus the end-of-turn term on the
turn-marker pairs, in one sum and one count (their teacher then also ships ``target_logprob``).

Legend: B rows, T student positions (whole rows), L of them on this CP rank (T at cp = 1), V
student lm_head width (its local shard under TP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from tokenbridge.losses.alm import AlmConfig, alm, alm_teacher_spec
from tokenbridge.losses.base import LossOutput
from tokenbridge.losses.gold import GoldConfig, GoldTables, gold, gold_teacher_spec
from tokenbridge.losses.modes.loss_mode import LossMode
from tokenbridge.losses.ops.cp_chunks import complete_chunks, owned_rows
from tokenbridge.losses.ops.segments import AlignedBatch, ChunkIndex, index_chunks
from tokenbridge.losses.ops.turns import ChunkSplit, eot, split_chunks, with_turns
from tokenbridge.losses.xtoken import XTokenConfig, XTokenTables, xtoken, xtoken_teacher_spec
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec

if TYPE_CHECKING:  # tokenbridge.dist_ops is imported lazily (see vocab_ops)
    from tokenbridge.dist_ops import CPContext


def chunk_count(index: ChunkIndex, cp: CPContext | None = None, *, term_row: str) -> int:
    """The complete chunks (both sides present and predicted) whose term this CP rank computes:
    the holder of the student row the mode evaluates the chunk at (``start``: the row predicting
    its first token, xtoken and alm; ``last``: the row predicting its last token, gold)."""
    chunks = complete_chunks(index)[0]
    if cp is None or cp.size == 1:
        return int(chunks.numel())
    rows = getattr(index.student, f"{term_row}_rows")()[chunks]
    return int(owned_rows(rows, cp)[1].sum())


class ChunkMode(LossMode):
    """A mode over aligned chunks: its `text_loss` on the text chunks, plus the end-of-turn
    term on the turn-marker pairs (conversations)."""

    chunked = True
    term_row: ClassVar[str] = "start"  # the student row a text chunk's term is computed at

    def prepare(self, aligned: AlignedBatch, targets_BT: Tensor) -> ChunkSplit:
        # the chunks every chunk mode keeps: both sides present and predicted, and trained
        return split_chunks(index_chunks(aligned), targets_BT)

    def count(self, split: ChunkSplit, cp: CPContext | None = None) -> int:
        # the text chunks at `term_row`, the end-of-turn pairs at their start rows (where `eot`
        # counts them)
        text = chunk_count(split.text, cp, term_row=self.term_row)
        return text + (0 if split.turns is None else chunk_count(split.turns, cp, term_row="start"))

    def teacher_rows(self, split: ChunkSplit, width: int) -> Tensor:
        return split.teacher_positions()

    def spec_for(self, spec: TeacherOutputSpec, *, turns: bool) -> TeacherOutputSpec:
        """Shards with turn-marker chunks (`turns`): the end-of-turn term reads the teacher's
        target log-probs."""
        if turns and not spec.target:
            return spec.union(TeacherOutputSpec(spec.vocab_size, target=True,
                                                temperature=spec.temperature))  # fmt: skip
        return spec

    def loss(
        self,
        logits_BLV: Tensor,
        outs: TeacherOutputs,
        split: ChunkSplit,
        *,
        tables: Any,
        vocab_size: int,
        config: Any,
        tp_group=None,
        cp: CPContext | None = None,
    ) -> LossOutput:
        layout = {"tp_group": tp_group, "cp": cp}
        text = self.text_loss(logits_BLV, outs, split.text, tables=tables, vocab_size=vocab_size,
                              config=config, **layout)  # fmt: skip
        if split.turns is None:
            return text
        return with_turns(text, eot(logits_BLV, outs, split.turns, vocab_size=vocab_size, **layout))

    def text_loss(
        self, logits_BLV: Tensor, outs: TeacherOutputs, index: ChunkIndex, *, tables: Any,
        vocab_size: int, config: Any, tp_group, cp: CPContext | None,
    ) -> LossOutput:  # fmt: skip
        """The mode's own loss over the chunks of `index` (`loss` adds the end-of-turn term)."""
        raise NotImplementedError


class XToken(ChunkMode):
    """Cross-tokenizer KD through the projection (`tokenbridge.losses.xtoken`)."""

    name = "xtoken"
    options = XTokenConfig
    projection = True

    def tables(self, projection, *, teacher_vocab_size: int, student_vocab_size: int):
        return XTokenTables.from_projection(projection, student_vocab_size=student_vocab_size)

    def teacher_spec(
        self, options: XTokenConfig, tables: Any, *, teacher_vocab_size: int
    ) -> TeacherOutputSpec:
        return xtoken_teacher_spec(options, teacher_vocab_size=teacher_vocab_size)

    def text_loss(self, logits_BLV, outs, index, *, tables, vocab_size, config, tp_group, cp):
        return xtoken(logits_BLV, outs, index, tables=tables, vocab_size=vocab_size,
                      config=config, tp_group=tp_group, cp=cp)  # fmt: skip


class Gold(ChunkMode):
    """GOLD's hybrid loss over the exact map and the unmatched tail (`tokenbridge.losses.gold`)."""

    name = "gold"
    options = GoldConfig
    projection = True
    term_row = "last"
    no_cache = (
        "it reads the teacher's log-probs on every exact-map id plus its largest unmatched "
        "probabilities at every position (about 46,000 + the unmatched student ids per "
        "token for Gemma x SmolLM2, ~200 kB in fp32), too wide to store; run gold with the "
        "live teacher, or xtoken / alm with the cache"
    )

    def tables(self, projection, *, teacher_vocab_size: int, student_vocab_size: int):
        return GoldTables.from_projection(
            projection, teacher_vocab_size=teacher_vocab_size, student_vocab_size=student_vocab_size
        )

    def teacher_spec(
        self, options: GoldConfig, tables: GoldTables, *, teacher_vocab_size: int
    ) -> TeacherOutputSpec:
        return gold_teacher_spec(options, tables, teacher_vocab_size=teacher_vocab_size)

    def columns(self, tables: GoldTables) -> Tensor:
        # the teacher scores the exact map's teacher ids at every position
        return tables.t_ids.cpu()

    def text_loss(self, logits_BLV, outs, index, *, tables, vocab_size, config, tp_group, cp):
        return gold(logits_BLV, outs, index, tables=tables, vocab_size=vocab_size,
                    config=config, tp_group=tp_group, cp=cp)  # fmt: skip


class Alm(ChunkMode):
    """Chunk-level likelihood matching, no projection (`tokenbridge.losses.alm`)."""

    name = "alm"
    options = AlmConfig

    def teacher_spec(
        self, options: AlmConfig, tables: None, *, teacher_vocab_size: int
    ) -> TeacherOutputSpec:
        return alm_teacher_spec(options, teacher_vocab_size=teacher_vocab_size)

    def text_loss(self, logits_BLV, outs, index, *, tables, vocab_size, config, tp_group, cp):
        return alm(logits_BLV, outs, index, vocab_size=vocab_size, config=config,
                   tp_group=tp_group, cp=cp)  # fmt: skip
