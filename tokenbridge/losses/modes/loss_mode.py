"""`LossMode`: what the trainer knows about a loss mode besides its math, and the ``ce`` mode.

The math lives in ``tokenbridge.losses.<mode>``; a mode class says which options it takes, what
its teacher computes, and how a batch becomes its loss (docs/losses.md, "The loss modes").
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenbridge.losses.base import OptionError
from tokenbridge.teacher.outputs import TeacherOutputSpec


@dataclass(frozen=True)
class NoOptions:
    """The options of a mode that takes none (``ce``)."""


class LossMode:
    """One loss mode as the trainer sees it. Who reads what:

    - the config: ``options`` (built by `parse_options`), ``onpolicy_only``, ``no_cache``, and
      once the tokenizers load, ``same_tokenizer`` / ``projection`` (`trainer.config.rules`);
    - once per teacher: ``tables(projection, *, teacher_vocab_size, student_vocab_size)``,
      ``teacher_spec(options, tables, *, teacher_vocab_size)`` then `spec_for`, and
      ``columns(tables)`` (the column ids the teacher scores, or None);
    - per microbatch: ``prepare(aligned, targets_BT)`` (the batch alone, so ``count(prep, cp)``
      is known before any forward), ``teacher_rows(prep, width)`` ([B, width] bool: the teacher
      positions the loss reads) and ``loss(logits_BLV, outs, prep, *, tables, vocab_size,
      config, tp_group, cp)`` (``config``: the options, as the loss functions name them).

    ``tables``, ``teacher_spec`` and ``teacher_rows`` are None where a mode has none (no
    projection; no teacher: ``ce``; the teacher's whole rows are read).

    Parallel layouts: ``prepare`` sees whole rows; ``logits_BLV`` are this rank's positions (CP)
    and vocabulary shard (TP: ``tp_group``); ``cp`` is a `CPContext` over the whole rows, or
    None at cp = 1. ``count`` counts the terms THIS rank's ``loss`` counts, so the step's count
    is their sum over dp and cp ranks (never over tp, whose ranks hold the same terms).
    """

    name: ClassVar[str]
    options: ClassVar[type] = NoOptions
    same_tokenizer: ClassVar[bool] = False  # compares distributions over the student's vocabulary
    projection: ClassVar[bool] = False  # reads the teacher -> student projection (`tables`)
    # why the mode cannot read an offline teacher cache (top-k, tail, target), or None
    no_cache: ClassVar[str | None] = None
    chunked: ClassVar[bool] = False  # reads a ChunkSplit: conversations add the end-of-turn term
    onpolicy_only: ClassVar[bool] = False  # reads rollouts (sampled ids, the policy's top-k)
    tables: Any = None
    teacher_spec: Any = None
    teacher_rows: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def distills(self) -> bool:
        """True for the KD modes (a teacher runs), False for ``ce``."""
        return self.teacher_spec is not None

    def columns(self, tables: Any) -> Any:
        """The column ids the teacher must score at every position (CPU), or None."""
        return None

    def spec_for(self, spec: TeacherOutputSpec, *, turns: bool) -> TeacherOutputSpec:
        """The teacher spec for shards with turn-marker chunks (`turns`); a chunk mode adds
        what its end-of-turn term reads."""
        return spec

    def check(self, options: Any) -> None:
        """Refuse options the fields alone cannot (OptionError); most modes have none."""

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


class CE(LossMode):
    """The student's own cross entropy: no teacher, no options (the loop computes it on every
    step, `trainer.loss_terms.ce_term`)."""

    name = "ce"
