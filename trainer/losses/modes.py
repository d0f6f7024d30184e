"""The loss-mode registry: one record per mode, read by the config, the preflight and the loop.

A `LossMode` says everything the trainer needs to know about a mode besides its math (which
lives in ``trainer.losses.<mode>``):

- `options`: the mode's options dataclass. Config validation (`trainer.config`) builds it from
  ``loss.options`` with `LossMode.parse_options`, field by field (unknown names, types, values),
  so a bad option fails in milliseconds, before any file is read or model loaded;
- `same_tokenizer` / `projection`: what the preflight checks (`trainer.preflight`): a
  same-tokenizer mode on a pair with two vocabularies is refused, a projection mode needs a
  projection file made for both tokenizers;
- `tables`, `teacher_spec`, `columns`: what the loop builds once per teacher
  (`trainer.distill.build_kd_terms`): the tables read from the projection, the teacher outputs
  the mode reads (never more) and the column ids the teacher must score;
- `no_cache`: why the mode cannot read an offline teacher cache (``teachers[i].cache``), or
  None: the cache stores top-k ids and log-probs, the tail and the target log-probs
  (`pipelines.teacher_cache.format`); a mode that reads only those builds its teacher spec
  without tables, and the preflight checks the cache against that spec;
- `prepare`, `count`, `loss`: what the loop calls per microbatch (`trainer.distill.KDTerm`).
  ``prepare`` sees the batch alone (the chunk index, or the mask of distilled positions), so
  ``count`` is known before any forward and the step's global count is all-reduced before its
  first backward.

Adding a mode is its loss module plus one record in `MODES`. ``ce`` is a record too (no
teacher, no options): the student's own cross entropy, computed by the loop on every step.

Legend: B rows, T student positions, V student lm_head width.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.losses.alm import AlmConfig, alm, alm_teacher_spec
from trainer.losses.base import LossOutput, OptionError
from trainer.losses.context import complete_chunks
from trainer.losses.gold import GoldConfig, GoldTables, gold, gold_teacher_spec
from trainer.losses.kd_topk import KDTopKConfig, kd_topk, kd_topk_teacher_spec
from trainer.losses.segments import AlignedBatch, ChunkIndex, index_chunks
from trainer.losses.teacher_outputs import TeacherOutputs, TeacherOutputSpec
from trainer.losses.xtoken import XTokenConfig, XTokenTables, xtoken, xtoken_teacher_spec


@dataclass(frozen=True)
class NoOptions:
    """The options of a mode that takes none (``ce``)."""


@dataclass(frozen=True)
class LossMode:
    """One loss mode as the trainer sees it (see the module docstring for who reads what).

    Signatures: ``tables(projection, *, teacher_vocab_size, student_vocab_size)``;
    ``teacher_spec(options, tables, *, teacher_vocab_size) -> TeacherOutputSpec``;
    ``columns(tables) -> Tensor | None``; ``prepare(aligned, targets_BT) -> prep``;
    ``count(prep) -> int``; ``loss(logits_BTV, outputs, prep, *, tables, vocab_size, config)
    -> LossOutput`` (``config``: the options, as the loss functions name them);
    ``check(options)`` refuses what the trainer cannot run (yet).
    """

    name: str
    options: type = NoOptions
    same_tokenizer: bool = False  # compares distributions over the student's own vocabulary
    projection: bool = False  # reads the teacher -> student projection (through `tables`)
    tables: Callable[..., Any] | None = None
    teacher_spec: Callable[..., TeacherOutputSpec] | None = None  # None: no teacher (ce)
    columns: Callable[[Any], Tensor | None] = lambda tables: None
    prepare: Callable[[AlignedBatch, Tensor], Any] | None = None
    count: Callable[[Any], int] | None = None
    loss: Callable[..., LossOutput] | None = None
    check: Callable[[Any], None] | None = None
    no_cache: str | None = None

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


def _chunk_index(aligned: AlignedBatch, targets_BT: Tensor) -> ChunkIndex:
    return index_chunks(aligned)


def _complete_chunk_count(index: ChunkIndex) -> int:
    # the chunks every chunk mode keeps (both sides present and predicted)
    return int(complete_chunks(index)[0].numel())


def _teacher_support_only(options: KDTopKConfig) -> None:
    if options.support != "teacher":
        raise OptionError(
            "kd_topk",
            "support",
            "the trainer takes only 'teacher' (its teacher runs a microbatch ahead of the "
            "student; 'columns' needs the student's logits first)",
        )


def _kd_topk_loss(logits_BTV, outs: TeacherOutputs, mask_BT, *, tables, vocab_size, config):
    # same tokenizer: the teacher's rows may be padded wider than the student's
    outs = outs.narrow_t(0, logits_BTV.shape[1])
    return kd_topk(logits_BTV, outs, mask_BT, vocab_size=vocab_size, config=config)


def _alm_loss(logits_BTV, outs: TeacherOutputs, index, *, tables, vocab_size, config):
    return alm(logits_BTV, outs, index, vocab_size=vocab_size, config=config)


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
        count=lambda mask_BT: int(mask_BT.sum()),
        loss=_kd_topk_loss,
        check=_teacher_support_only,
    ),
    "xtoken": LossMode(
        "xtoken",
        XTokenConfig,
        projection=True,
        tables=_xtoken_tables,
        teacher_spec=_without_tables(xtoken_teacher_spec),
        prepare=_chunk_index,
        count=_complete_chunk_count,
        loss=xtoken,
    ),
    "gold": LossMode(
        "gold",
        GoldConfig,
        projection=True,
        tables=GoldTables.from_projection,
        teacher_spec=gold_teacher_spec,
        columns=_gold_columns,
        prepare=_chunk_index,
        count=_complete_chunk_count,
        loss=gold,
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
        prepare=_chunk_index,
        count=_complete_chunk_count,
        loss=_alm_loss,
    ),
}

# the modes a teacher can be given (``teachers[i].loss``): every mode but ce
KD_MODES = tuple(name for name, mode in MODES.items() if mode.distills)
