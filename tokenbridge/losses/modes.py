"""The loss-mode registry: one record per mode, read by the config, the preflight and the loop.

A `LossMode` says everything the trainer needs to know about a mode besides its math (which
lives in ``tokenbridge.losses.<mode>``):

- `options`: the mode's options dataclass. Config validation (`trainer.config`) builds it from
  ``loss.options`` with `LossMode.parse_options`, field by field (unknown names, types, values),
  so a bad option fails in milliseconds, before any file is read or model loaded;
- `same_tokenizer` / `projection`: what the config's rules check once the tokenizers are
  loaded (`trainer.config.rules.check_tokenizers`, off- and on-policy alike): a same-tokenizer
  mode on a pair with two vocabularies is refused, a projection mode needs a projection file
  (which the preflight then checks against both tokenizers);
- `tables`, `teacher_spec`, `columns`: what the loop builds once per teacher
  (`trainer.loss_terms.build_kd_terms`): the tables read from the projection, the teacher outputs
  the mode reads (never more) and the column ids the teacher must score;
- `no_cache`: why the mode cannot read an offline teacher cache (``teachers[i].cache``), or
  None: the cache stores top-k ids and log-probs, the tail and the target log-probs
  (`tokenbridge.formats.teacher_cache`); a mode that reads only those builds its teacher spec
  without tables, and the preflight checks the cache against that spec;
- `onpolicy_only`: a mode that reads the student's own samples (`trainer.onpolicy`): the
  on-policy step may use it (``onpolicy.loss``), an off-policy ``loss.mode`` may not;
- `prepare`, `count`, `loss`: what the loop calls per microbatch (`trainer.loss_terms.KDTerm`).
  ``prepare`` sees the batch alone (the chunk index, or the mask of distilled positions), so
  ``count`` is known before any forward and the step's global count is all-reduced before its
  first backward. ``teacher_rows`` says, from the same preparation, which teacher positions the
  loss reads: the teacher computes outputs there only.

Conversations: the targets ``prepare`` receives are masked by the shards' train flags. The
chunk modes (``chunked``) prepare a `turns.ChunkSplit`: their own loss on the trained text
chunks, plus the end-of-turn term (`turns.eot`) on the trained turn-marker pairs, in one sum and
one count; their teacher then also ships ``target_logprob`` (`LossMode.spec_for`).

Adding a mode is its loss module plus one record in `MODES`. ``ce`` is a record too (no
teacher, no options): the student's own cross entropy, computed by the loop on every step.

Legend: B rows, T student positions (whole rows), L of them on this CP rank (T at cp = 1), V
student lm_head width (its local shard under TP).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tokenbridge.losses.alm import AlmConfig, alm, alm_teacher_spec
from tokenbridge.losses.base import LossOutput, OptionError
from tokenbridge.losses.gold import GoldConfig, GoldTables, gold, gold_teacher_spec
from tokenbridge.losses.kd_topk import KDTopKConfig, kd_topk, kd_topk_teacher_spec
from tokenbridge.losses.opd import (
    OPDPGConfig,
    OPDTopKConfig,
    opd_pg,
    opd_pg_teacher_spec,
    opd_topk,
    opd_topk_teacher_spec,
)
from tokenbridge.losses.ops.cp_chunks import complete_chunks, owned_rows
from tokenbridge.losses.ops.segments import AlignedBatch, ChunkIndex, index_chunks
from tokenbridge.losses.ops.turns import ChunkSplit, eot, split_chunks, with_turns
from tokenbridge.losses.xtoken import XTokenConfig, XTokenTables, xtoken, xtoken_teacher_spec
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec

if TYPE_CHECKING:  # tokenbridge.dist_ops is imported lazily (see vocab_ops)
    from tokenbridge.dist_ops import CPContext


@dataclass(frozen=True)
class NoOptions:
    """The options of a mode that takes none (``ce``)."""


@dataclass(frozen=True)
class LossMode:
    """One loss mode as the trainer sees it (see the module docstring for who reads what).

    Signatures: ``tables(projection, *, teacher_vocab_size, student_vocab_size)``;
    ``teacher_spec(options, tables, *, teacher_vocab_size) -> TeacherOutputSpec``;
    ``columns(tables) -> Tensor | None``; ``prepare(aligned, targets_BT) -> prep``;
    ``count(prep, cp) -> int``; ``loss(logits_BLV, outputs, prep, *, tables, vocab_size,
    config, tp_group, cp) -> LossOutput`` (``config``: the options, as the loss functions name
    them); ``teacher_rows(prep, width) -> [B, width] bool`` (the teacher positions read);
    ``check(options)`` refuses what the trainer cannot run (yet).

    Parallel layouts: ``prepare`` sees whole rows; ``logits_BLV`` are this rank's positions (the
    CP layout) and vocabulary shard (TP: ``tp_group``); ``cp`` is a `CPContext` over the whole
    rows, or None at cp = 1. ``count`` counts the terms THIS rank's ``loss`` will count, so the
    loop's global count is their sum over dp and cp ranks (never over tp, whose ranks hold the
    same terms).
    """

    name: str
    options: type = NoOptions
    same_tokenizer: bool = False  # compares distributions over the student's own vocabulary
    projection: bool = False  # reads the teacher -> student projection (through `tables`)
    tables: Callable[..., Any] | None = None
    teacher_spec: Callable[..., TeacherOutputSpec] | None = None  # None: no teacher (ce)
    columns: Callable[[Any], Tensor | None] = lambda tables: None
    prepare: Callable[[AlignedBatch, Tensor], Any] | None = None
    count: Callable[[Any, CPContext | None], int] | None = None
    loss: Callable[..., LossOutput] | None = None
    check: Callable[[Any], None] | None = None
    no_cache: str | None = None
    teacher_rows: Callable[[Any, int], Tensor] | None = None
    chunked: bool = False  # reads a ChunkIndex: conversations add the end-of-turn term
    onpolicy_only: bool = False  # reads rollouts (sampled ids, the policy's top-k)

    def spec_for(self, spec: TeacherOutputSpec, *, turns: bool) -> TeacherOutputSpec:
        """The teacher spec for shards with turn-marker chunks (`turns`): a chunk mode's
        end-of-turn term reads the teacher's target log-probs."""
        if turns and self.chunked and not spec.target:
            return spec.union(TeacherOutputSpec(spec.vocab_size, target=True,
                                                temperature=spec.temperature))  # fmt: skip
        return spec

    @property
    def distills(self) -> bool:
        """True for the KD modes (a teacher runs), False for ``ce``."""
        return self.teacher_spec is not None

    def parse_options(self, given: Mapping[str, Any], *, temperature: float) -> Any:
        """The options dataclass from ``given`` (``loss.options``); ``temperature``
        (``loss.temperature``) fills a ``temperature`` field that ``given`` leaves unset.
        Raises `OptionError` naming the first bad field and saying what it expected."""
        cls, mode = self.options, self.name
        names = [f.name for f in dataclasses.fields(cls)]
        for key in given:
            if key not in names:
                raise OptionError(mode, key, f"{mode} takes only {sorted(names)}, not {key!r}")
        hints = typing.get_type_hints(cls)
        for key, value in given.items():
            if not _fits(value, hints[key]):
                want = _type_name(hints[key])
                raise OptionError(mode, key, f"{mode}: expected {want}, got {value!r}")
        opts = dict(given)
        if "temperature" in names and "temperature" not in opts:
            opts["temperature"] = temperature
        try:
            options = cls(**opts)
            if self.check is not None:
                self.check(options)
        except OptionError as e:
            raise OptionError(mode, e.field, f"{mode}: {e.reason}") from None
        return options


def _fits(value: Any, hint: Any) -> bool:
    """Does a config value fit an options field's annotation (int, float, str, bool, X | None)?
    bool is not an int here, and an int is a float (Hydra reads ``beta=1`` as an int)."""
    if typing.get_args(hint):  # X | None
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if args:
        return " or ".join(_type_name(h) for h in args)
    return "None" if hint is type(None) else hint.__name__


# ---------------------------------------------------------------------------------------------
# per-microbatch hooks shared by several modes


def _position_mask(aligned: AlignedBatch, targets_BT: Tensor) -> Tensor:
    """Same tokenizer: distill every position that predicts a token (targets -1: none)."""
    if not torch.equal(aligned.teacher_len, aligned.student_len):
        raise ValueError(
            "kd_topk needs identical tokenizations, the rows have lengths "
            f"{aligned.teacher_len.tolist()} (teacher) vs {aligned.student_len.tolist()} (student)"
        )
    return targets_BT >= 0


def _position_rows(mask_BT: Tensor, width: int) -> Tensor:
    """Same tokenizer: the teacher reads the distilled positions (its rows may be wider)."""
    rows = mask_BT.new_zeros((mask_BT.shape[0], width))
    n = min(width, mask_BT.shape[1])
    rows[:, :n] = mask_BT[:, :n]
    return rows


def _position_count(mask_BT: Tensor, cp: CPContext | None = None) -> int:
    # the distilled positions this CP rank holds
    return int((mask_BT if cp is None else cp.shard(mask_BT)).sum())


def _chunk_count(term_row: str) -> Callable[[ChunkIndex, CPContext | None], int]:
    """The complete chunks (both sides present and predicted) whose term this CP rank computes:
    the holder of the student row the mode evaluates the chunk at (``start``: the row predicting
    its first token, xtoken and alm; ``last``: the row predicting its last token, gold)."""

    def count(index: ChunkIndex, cp: CPContext | None = None) -> int:
        chunks = complete_chunks(index)[0]
        if cp is None or cp.size == 1:
            return int(chunks.numel())
        rows = getattr(index.student, f"{term_row}_rows")()[chunks]
        return int(owned_rows(rows, cp)[1].sum())

    return count


def _split_count(term_row: str) -> Callable[[ChunkSplit, CPContext | None], int]:
    """A chunk mode's count over a `ChunkSplit`: its text chunks at ``term_row`` and the
    end-of-turn pairs at their start rows (where `eot` counts them)."""
    text, turns = _chunk_count(term_row), _chunk_count("start")

    def count(split: ChunkSplit, cp: CPContext | None = None) -> int:
        return text(split.text, cp) + (0 if split.turns is None else turns(split.turns, cp))

    return count


def _chunk_split(aligned: AlignedBatch, targets_BT: Tensor) -> ChunkSplit:
    # the chunks every chunk mode keeps: both sides present and predicted, and trained
    return split_chunks(index_chunks(aligned), targets_BT)


def _chunk_rows(split: ChunkSplit, width: int) -> Tensor:
    return split.teacher_positions()


def _chunk_mode(loss_fn: Callable[..., LossOutput]) -> Callable[..., LossOutput]:
    """A chunk mode's loss over a `ChunkSplit`: its own term on the text chunks, plus the
    end-of-turn term on the turn-marker pairs (conversations)."""

    def loss(logits_BTV, outs: TeacherOutputs, split: ChunkSplit, *, tables, vocab_size, config,
             **kw) -> LossOutput:  # fmt: skip
        text = loss_fn(logits_BTV, outs, split.text, tables=tables, vocab_size=vocab_size,
                       config=config, **kw)  # fmt: skip
        if split.turns is None:
            return text
        return with_turns(text, eot(logits_BTV, outs, split.turns, vocab_size=vocab_size, **kw))

    return loss


def _teacher_support_only(options: KDTopKConfig) -> None:
    if options.support != "teacher":
        raise OptionError(
            "kd_topk",
            "support",
            "the trainer takes only 'teacher' (its teacher runs a microbatch ahead of the "
            "student; 'columns' needs the student's logits first)",
        )


def _kd_topk_loss(
    logits_BLV, outs: TeacherOutputs, mask_BT, *, tables, vocab_size, config, tp_group=None, cp=None
):
    # same tokenizer: the teacher's rows may be padded wider than the student's; under CP the
    # student holds its own positions of them (the teacher ran the whole rows)
    outs = outs.narrow_t(0, mask_BT.shape[1])
    if cp is not None:
        outs, mask_BT = outs.cp_shard(cp), cp.shard(mask_BT)
    return kd_topk(
        logits_BLV, outs, mask_BT, vocab_size=vocab_size, config=config, tp_group=tp_group
    )


def _whole_rows(mode: str, tp_group, cp) -> None:
    # the on-policy step gives these whole logits on whole rows (`trainer.onpolicy.rollout_source`)
    if tp_group is not None or cp is not None:
        raise ValueError(f"{mode} takes whole logits on whole rows, not a TP/CP shard")


def _opd_topk_loss(
    logits_BTV, outs: TeacherOutputs, mask_BT, *, tables, vocab_size, config, tp_group=None, cp=None
):
    _whole_rows("opd_topk", tp_group, cp)
    outs = outs.narrow_t(0, logits_BTV.shape[1])
    return opd_topk(logits_BTV, outs, mask_BT, vocab_size=vocab_size, config=config)


def _opd_pg_loss(
    logits_BTV, outs: TeacherOutputs, index, *, tables, vocab_size, config, tp_group=None, cp=None
):
    _whole_rows("opd_pg", tp_group, cp)
    return opd_pg(logits_BTV, outs, index, vocab_size=vocab_size, config=config)


def _rollout_chunks(aligned: AlignedBatch, targets_BT: Tensor) -> ChunkIndex:
    # the rollout rows aligned on the fly (`trainer.onpolicy.realign`); no train mask to apply
    return index_chunks(aligned)


def _alm_loss(
    logits_BLV, outs: TeacherOutputs, index, *, tables, vocab_size, config, tp_group=None, cp=None
):
    return alm(
        logits_BLV, outs, index, vocab_size=vocab_size, config=config, tp_group=tp_group, cp=cp
    )


def _xtoken_tables(projection, *, teacher_vocab_size: int, student_vocab_size: int):
    return XTokenTables.from_projection(projection, student_vocab_size=student_vocab_size)


def _gold_columns(tables: GoldTables) -> Tensor:
    # the teacher scores the exact map's teacher ids at every position
    return tables.t_ids.cpu()


def _without_tables(spec_fn: Callable[..., TeacherOutputSpec]) -> Callable[..., TeacherOutputSpec]:
    """A teacher-spec builder that reads no tables, in the registry's signature."""

    def spec(options, tables, *, teacher_vocab_size: int) -> TeacherOutputSpec:
        return spec_fn(options, teacher_vocab_size=teacher_vocab_size)

    return spec


MODES: dict[str, LossMode] = {
    "ce": LossMode("ce"),
    "kd_topk": LossMode(
        "kd_topk",
        KDTopKConfig,
        same_tokenizer=True,
        teacher_spec=_without_tables(kd_topk_teacher_spec),
        prepare=_position_mask,
        count=_position_count,
        loss=_kd_topk_loss,
        check=_teacher_support_only,
        teacher_rows=_position_rows,
    ),
    "xtoken": LossMode(
        "xtoken",
        XTokenConfig,
        projection=True,
        tables=_xtoken_tables,
        teacher_spec=_without_tables(xtoken_teacher_spec),
        prepare=_chunk_split,
        count=_split_count("start"),
        loss=_chunk_mode(xtoken),
        teacher_rows=_chunk_rows,
        chunked=True,
    ),
    "gold": LossMode(
        "gold",
        GoldConfig,
        projection=True,
        tables=GoldTables.from_projection,
        teacher_spec=gold_teacher_spec,
        columns=_gold_columns,
        prepare=_chunk_split,
        count=_split_count("last"),
        loss=_chunk_mode(gold),
        teacher_rows=_chunk_rows,
        chunked=True,
        no_cache=(
            "it reads the teacher's log-probs on every exact-map id plus its largest unmatched "
            "probabilities at every position (about 46,000 + the unmatched student ids per "
            "token for Gemma x SmolLM2, ~200 kB in fp32), too wide to store; run gold with the "
            "live teacher, or xtoken / alm with the cache"
        ),
    ),
    "alm": LossMode(
        "alm",
        AlmConfig,
        teacher_spec=_without_tables(alm_teacher_spec),
        prepare=_chunk_split,
        count=_split_count("start"),
        loss=_chunk_mode(_alm_loss),
        teacher_rows=_chunk_rows,
        chunked=True,
    ),
    # on-policy (trainer.onpolicy): the student's own samples, scored by the teacher
    "opd_topk": LossMode(
        "opd_topk",
        OPDTopKConfig,
        same_tokenizer=True,
        teacher_spec=_without_tables(opd_topk_teacher_spec),
        prepare=_position_mask,
        count=_position_count,
        loss=_opd_topk_loss,
        onpolicy_only=True,
    ),
    "opd_pg": LossMode(
        "opd_pg",
        OPDPGConfig,
        teacher_spec=_without_tables(opd_pg_teacher_spec),
        prepare=_rollout_chunks,
        count=_chunk_count("start"),
        loss=_opd_pg_loss,
        onpolicy_only=True,
    ),
}

# the modes a teacher can be given (``teachers[i].loss``): every mode but ce
KD_MODES = tuple(name for name, mode in MODES.items() if mode.distills)
