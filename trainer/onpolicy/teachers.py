"""The on-policy teachers of a run: their loss terms and how each reads a rollout.

Per teacher with a non-zero weight, one `KDTerm` for its on-policy mode, whose teacher spec
adds the realised token's log-prob, and a `TeacherView` where its tokenizer differs from the
student's (None: the sampled ids are scored as they are). What cannot run was refused by the
config's rules (`trainer.config.rules`) before any model loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenbridge.chat.align import ChatSide, prepare_side
from tokenbridge.chat.templates import resolve_template
from tokenbridge.losses.modes import MODES
from tokenbridge.projection import load_projection
from tokenbridge.tokenizers import Tokenizer
from trainer.config.schema import TrainConfig
from trainer.loss_terms import KDTerm
from trainer.onpolicy.realign import TeacherView
from trainer.onpolicy.rollout_scoring import scoring_spec


@dataclass
class OnPolicyTeachers:
    """Per kept teacher (weight > 0), in config order."""

    terms: list[KDTerm]
    views: list[TeacherView | None]  # None: the student's own tokenizer
    topk: int  # the sampling policy's top-k the teachers score (0: none)
    stop_ids: list[int]  # the student's stop ids (EOS, end-of-turn)


def _chat_side(cfg: TrainConfig, i: int, tok: Tokenizer) -> ChatSide | None:
    op = cfg.onpolicy
    if op.prompts != "chat":
        return None
    names = op.teacher_chat_templates
    override = names[i] if i < len(names) and names[i] else None
    return prepare_side(tok, resolve_template(cfg.teachers[i].path, override=override))


def stop_for(tok: Tokenizer, side: ChatSide | None) -> int | None:
    """The teacher's own marker for "the completion ends here"."""
    if side is not None and side.markers is not None and len(side.markers.close_ids):
        return int(side.markers.close_ids[0])
    return tok.eos_id


def build_teachers(
    cfg: TrainConfig,
    *,
    student: Tokenizer,
    teachers: list[Tokenizer],
    student_chat: ChatSide | None,
    max_len: int,
) -> OnPolicyTeachers:
    """Terms and views of the on-policy teachers, one per teacher with a weight. ``max_len``:
    the longest student row of a rollout; a teacher's slot holds twice that (another tokenizer
    may need more tokens for the same bytes; a longer rollout is dropped and counted)."""
    op = cfg.onpolicy
    terms, views = [], []
    topk = 0
    for i, (t_cfg, tok, mode) in enumerate(zip(cfg.teachers, teachers, op.modes(len(teachers)))):
        if t_cfg.weight == 0:
            continue
        record = MODES[mode]
        options = op.mode_options(mode, cfg.loss.temperature)
        tables = None
        if record.tables is not None:
            projection = load_projection(
                t_cfg.projection, teacher=tok.info(), student=student.info()
            )
            tables = record.tables(
                projection, teacher_vocab_size=tok.vocab_size, student_vocab_size=student.vocab_size
            )
        spec = scoring_spec(record.teacher_spec(options, tables, teacher_vocab_size=tok.vocab_size))
        if spec.per_position_columns:
            topk = max(topk, spec.columns)
        terms.append(
            KDTerm(i, t_cfg.name, mode, options, spec, tables, student.vocab_size, t_cfg.weight)
        )
        if tok.fingerprint == student.fingerprint:
            views.append(None)
            continue
        side = _chat_side(cfg, i, tok)
        views.append(TeacherView(tok, view_len(max_len), side, stop_for(tok, side)))
    assert terms, "trainer.config.rules: on-policy distillation needs a teacher with weight > 0"
    stops = {student.eos_id} if student.eos_id is not None else set()
    if student_chat is not None and student_chat.markers is not None:
        stops |= {int(i) for i in student_chat.markers.close_ids}
    return OnPolicyTeachers(terms, views, topk, sorted(stops))


def rollout_max_len(cfg: TrainConfig) -> int:
    """The longest student row of a rollout: its prompt and completion, padded."""
    op, pad = cfg.onpolicy, cfg.data.pad_to_multiple
    prompt_max = op.prompt_tokens if op.prompts == "text" else cfg.data.max_student_tokens
    return -(-(prompt_max + op.max_new_tokens) // pad) * pad


def view_len(max_len: int) -> int:
    """A teacher row's slot for a student row of ``max_len`` when their tokenizers differ (another
    tokenizer may need more tokens for the same bytes)."""
    return 2 * max_len + 8


def teacher_max_len(views: list[TeacherView | None], student_max: int) -> list[int]:
    """Slot length per teacher: the student's rows for its own tokenizer, else the view's."""
    return [student_max if v is None else v.max_len for v in views]
