"""Conversation rows: the three row formats, parsed and checked before any template sees them.

A file holds ``messages``, ``prompt_completion`` or ``text`` rows, detected from its first row. A
bad row never crashes and never passes silently: `parse_row` returns a `DeadLetter` with a stable
reason, the field and what was found; every reason (templates' and fitting's too) is listed here.
Assistant ``tool_calls`` are refused: each template renders them its own way, leaving nothing
common to align.
"""

from __future__ import annotations

from dataclasses import dataclass

# row formats
MESSAGES, PROMPT_COMPLETION, TEXT = "messages", "prompt_completion", "text"
ROW_FORMATS = (MESSAGES, PROMPT_COMPLETION, TEXT)

ROLES = ("system", "user", "assistant", "tool")
ROLE_ID = {r: i for i, r in enumerate(ROLES)}  # the int8 role codes in per-token arrays

# train-flag modes (see tokenbridge.chat.align.train_flags)
TRAIN_ASSISTANT, TRAIN_LAST, TRAIN_ALL = "assistant", "last_assistant", "all"
TRAIN_MODES = (TRAIN_ASSISTANT, TRAIN_LAST, TRAIN_ALL)

# dead-letter reasons (stable strings: counter names and stats keys)
MISSING_FIELD = "missing_field"
BAD_FIELD_TYPE = "bad_field_type"
BAD_MESSAGE = "bad_message"
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
EMPTY_ASSISTANT = "empty_assistant"
NOTHING_TO_TRAIN = "nothing_to_train"
TOOL_CALLS = "tool_calls"
UNSUPPORTED_FIELD = "unsupported_field"
TEMPLATE_ERROR = "template_error"  # the template raised (raise_exception, a jinja error)
TEMPLATE_DROPPED = "template_dropped"  # a message's content is missing from a rendering
TEMPLATE_REWROTE = "template_rewrote"  # a content is not in a rendering verbatim
TOO_LONG = "too_long"  # longer than a window (applied with the windows, in the job)
UNDECODABLE = "undecodable_utf8"  # a lone surrogate (from a JSON \\u escape) has no UTF-8

# message keys passed to the templates as they are; anything else is refused, never dropped
_PASSED_KEYS = ("name", "tool_call_id")
_KNOWN_KEYS = frozenset(("role", "content", "tool_calls", *_PASSED_KEYS))


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Why a row was refused; `side` names the tokenizer whose template refused it."""

    reason: str
    field: str
    detail: str
    side: str | None = None

    def record(self, *, file: str, row: int | None = None, doc_id: str | None = None) -> dict:
        """The job's dead-letter record (the readers' shape: file, row, field, reason, detail)."""
        detail = self.detail if self.side is None else f"{self.side}: {self.detail}"
        return {
            "file": file,
            "row": row,
            "line": None if row is None else row + 1,
            "field": self.field,
            "doc_id": doc_id,
            "reason": self.reason,
            "detail": detail,
        }


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    trainable: bool  # an assistant turn train flags may select (p/c rows: completion only)
    extra: tuple[tuple[str, str], ...] = ()  # (key, value) passed to templates: name, ...

    def as_dict(self, content: str | None = None) -> dict:
        """The dict a chat template sees (optionally with another content, e.g. marked)."""
        d = {"role": self.role, "content": self.content if content is None else content}
        d.update(self.extra)
        return d


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: tuple[Message, ...]

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(m.role for m in self.messages)


def detect_format(row, *, where: str = "<row>") -> str:
    """The format of a file from its first row; raises ValueError naming what it found."""
    if isinstance(row, dict):
        if MESSAGES in row:
            return MESSAGES
        if "prompt" in row and "completion" in row:
            return PROMPT_COMPLETION
        if TEXT in row:
            return TEXT
        found = sorted(row)[:10]
    else:
        found = type(row).__name__
    raise ValueError(
        f"{where}: cannot tell the row format: expected a 'messages' field, 'prompt' + "
        f"'completion', or 'text'; found {found}. Name it with the row-format flag "
        f"({', '.join(ROW_FORMATS)})."
    )


def _message(m, field: str, *, trainable: bool) -> Message | DeadLetter:
    if not isinstance(m, dict):
        return DeadLetter(BAD_MESSAGE, field, f"a message is a dict, found {type(m).__name__}")
    if "role" not in m or "content" not in m:
        return DeadLetter(MISSING_FIELD, field, f"a message needs role and content: {sorted(m)}")
    role, content = m["role"], m["content"]
    if role not in ROLE_ID:
        return DeadLetter(UNKNOWN_ROLE, f"{field}.role", f"{role!r} is not one of {ROLES}")
    if m.get("tool_calls"):
        return DeadLetter(
            TOOL_CALLS,
            f"{field}.tool_calls",
            "structured tool calls are rendered differently by every template and cannot be "
            "aligned by text; refused",
        )
    unknown = sorted(set(m) - _KNOWN_KEYS)
    if unknown:
        return DeadLetter(
            UNSUPPORTED_FIELD,
            f"{field}.{unknown[0]}",
            f"message keys {unknown} are not supported (known: {sorted(_KNOWN_KEYS)})",
        )
    if not isinstance(content, str):
        return DeadLetter(
            NON_STRING_CONTENT, f"{field}.content", f"content is {type(content).__name__}"
        )
    if not content.isascii():
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:
            return DeadLetter(UNDECODABLE, f"{field}.content", f"{e.reason} at char {e.start}")
    if role == "assistant" and not content.strip():
        return DeadLetter(EMPTY_ASSISTANT, f"{field}.content", f"assistant content {content!r}")
    extra = []
    for k in _PASSED_KEYS:
        if m.get(k) is not None:
            if not isinstance(m[k], str):
                return DeadLetter(BAD_FIELD_TYPE, f"{field}.{k}", f"{type(m[k]).__name__}")
            extra.append((k, m[k]))
    return Message(role, content, trainable and role == "assistant", tuple(extra))


def _messages(value, field: str, *, trainable: bool) -> list[Message] | DeadLetter:
    if not isinstance(value, list):
        return DeadLetter(
            BAD_FIELD_TYPE, field, f"a list of messages, found {type(value).__name__}"
        )
    out = []
    for i, m in enumerate(value):
        msg = _message(m, f"{field}[{i}]", trainable=trainable)
        if isinstance(msg, DeadLetter):
            return msg
        out.append(msg)
    return out


def _side(value, field: str, role: str, *, trainable: bool) -> list[Message] | DeadLetter:
    """A prompt or completion: a string (one `role` turn) or a list of messages."""
    if isinstance(value, str):
        return _messages([{"role": role, "content": value}], field, trainable=trainable)
    return _messages(value, field, trainable=trainable)


def parse_row(row, *, fmt: str, train_on: str = TRAIN_ASSISTANT) -> Conversation | DeadLetter:
    """One ``messages`` or ``prompt_completion`` row -> Conversation, or why not."""
    if fmt not in (MESSAGES, PROMPT_COMPLETION):
        raise ValueError(f"parse_row reads {MESSAGES!r} or {PROMPT_COMPLETION!r} rows, not {fmt!r}")
    if train_on not in TRAIN_MODES:
        raise ValueError(f"train_on must be one of {TRAIN_MODES}, got {train_on!r}")
    if not isinstance(row, dict):
        return DeadLetter(BAD_FIELD_TYPE, "", f"a row is a JSON object, found {type(row).__name__}")
    if row.get("tools"):
        return DeadLetter(TOOL_CALLS, "tools", "tool schemas are rendered per template; refused")
    if fmt == MESSAGES:
        if MESSAGES not in row:
            return DeadLetter(MISSING_FIELD, MESSAGES, f"no 'messages' (found {sorted(row)[:10]})")
        msgs = _messages(row[MESSAGES], MESSAGES, trainable=True)
    else:
        missing = [k for k in ("prompt", "completion") if k not in row]
        if missing:
            return DeadLetter(MISSING_FIELD, missing[0], f"no {missing} (found {sorted(row)[:10]})")
        prompt = _side(row["prompt"], "prompt", "user", trainable=False)
        if isinstance(prompt, DeadLetter):
            return prompt
        completion = _side(row["completion"], "completion", "assistant", trainable=True)
        msgs = completion if isinstance(completion, DeadLetter) else prompt + completion
    if isinstance(msgs, DeadLetter):
        return msgs
    if not msgs:
        return DeadLetter(BAD_MESSAGE, MESSAGES, "the conversation has no messages")
    if train_on != TRAIN_ALL and not any(m.trainable for m in msgs):
        where = "completion" if fmt == PROMPT_COMPLETION else MESSAGES
        return DeadLetter(
            NOTHING_TO_TRAIN,
            where,
            f"no assistant turn to train on (roles {[m.role for m in msgs]})",
        )
    return Conversation(tuple(msgs))
