"""Render a conversation with one template and locate every message's content in the rendering.

Searching a rendering for a content is not safe (it can also occur in the template's own text
before it), so each conversation is rendered twice by the same call, once with every content
between two private-use marks: the marks give the content spans, and removing them must give
the real rendering. Edge whitespace left out is the one rewrite accepted (`tokenbridge.chat.edges`);
any other is a dead letter, never aligned at a guessed position (docs/alignment.md, "Conversations").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenbridge.chat import rows
from tokenbridge.chat.edges import locate_trimmed, removed_bytes
from tokenbridge.chat.rows import Conversation, DeadLetter
from tokenbridge.chat.templates import ChatTemplate, render

# marker pairs, tried in order until one has no character in the conversation's text
_MARKERS = (("\U000f0001", "\U000f0002"), ("\U000f0003", "\U000f0004"), ("\ue000", "\ue001"))


@dataclass(frozen=True)
class Rendering:
    text: str  # the real rendering
    spans: np.ndarray  # int64 [n_messages, 2]: char span [start, end) of each content in text
    # int64 [n_messages, 2]: UTF-8 bytes of each content's leading / trailing whitespace that the
    # rendering leaves out (`tokenbridge.chat.edges`); None: every content verbatim
    cut: np.ndarray | None = None


def _markers(conv: Conversation) -> tuple[str, str] | None:
    for pair in _MARKERS:
        if not any(c in m.content or any(c in v for _, v in m.extra) for m in conv.messages
                   for c in pair):  # fmt: skip
            return pair
    return None


def _try_render(template: ChatTemplate, messages: list[dict], specials: dict[str, str]):
    try:
        return render(template, messages, **specials), None
    except Exception as e:  # the template is user code: any error it raises refuses the row
        return None, f"{type(e).__name__}: {e}"


def _strip_markers(marked: str, pair: tuple[str, str]) -> tuple[str, list[tuple[int, int]], str]:
    """(text without markers, [(start, end)] spans in it, problem or "")."""
    open_, close = pair
    parts, spans = [], []
    pos, out_len = 0, 0
    while True:
        a = marked.find(open_, pos)
        if a < 0:
            tail = marked[pos:]
            if close in tail:
                return "", [], "a closing marker without its opening one"
            parts.append(tail)
            break
        b = marked.find(close, a + 1)
        if b < 0:
            return "", [], "an opening marker without its closing one"
        inner = marked[a + 1 : b]
        if open_ in inner:
            return "", [], "markers nested: a content rendered inside another"
        head = marked[pos:a]
        if close in head:
            return "", [], "a closing marker without its opening one"
        parts.append(head)
        out_len += len(head)
        spans.append((out_len, out_len + len(inner)))
        parts.append(inner)
        out_len += len(inner)
        pos = b + 1
    return "".join(parts), spans, ""


def render_conversation(
    conv: Conversation,
    template: ChatTemplate,
    *,
    bos_token: str,
    eos_token: str,
    side: str,
    transparent: bool = False,
) -> Rendering | DeadLetter:
    """Render `conv` with `template` and locate each content (see the module docstring).

    transparent: the template only writes contents (`templates.content_transparent`), so the
    marked rendering without its markers is the real one and the second render is skipped.
    """
    specials = {"bos_token": bos_token, "eos_token": eos_token}
    real = None
    if not transparent:
        real, err = _try_render(template, [m.as_dict() for m in conv.messages], specials)
        if err is not None:
            return DeadLetter(rows.TEMPLATE_ERROR, "messages", err, side)
    pair = _markers(conv)
    if pair is None:  # contents use every marker we have: cannot locate them safely
        return DeadLetter(
            rows.TEMPLATE_REWROTE, "messages", "contents hold private-use marks", side
        )
    marked_msgs = [m.as_dict(pair[0] + m.content + pair[1]) for m in conv.messages]
    marked, err = _try_render(template, marked_msgs, specials)
    if err is not None:
        reason = rows.TEMPLATE_ERROR if transparent else rows.TEMPLATE_REWROTE
        return DeadLetter(
            reason, "messages", err if transparent else f"depends on content: {err}", side
        )
    text, spans, problem = _strip_markers(marked, pair)
    real = text if transparent else real
    n = len(conv.messages)
    if not problem and len(spans) < n:
        first = _first_missing(conv, text, spans)
        return DeadLetter(
            rows.TEMPLATE_DROPPED,
            f"messages[{first}].content",
            f"the template renders {len(spans)} of {n} contents; "
            f"message {first} ({conv.messages[first].role}) is not in the rendering",
            side,
        )
    if not problem and len(spans) > n:
        problem = f"the template renders {len(spans)} contents for {n} messages"
    if not problem:
        for i, ((a, b), m) in enumerate(zip(spans, conv.messages)):
            if text[a:b] != m.content:  # the template wrote something else between the markers
                problem = f"message {i} is rendered as {text[a:b][:60]!r}, not verbatim"
                break
    if not problem and text != real:
        return _trimmed(conv, real, text, spans, side)
    if problem:
        return DeadLetter(rows.TEMPLATE_REWROTE, "messages", problem, side)
    return Rendering(real, np.array(spans, dtype=np.int64).reshape(n, 2))


def _trimmed(conv: Conversation, real: str, text: str, spans, side: str) -> Rendering | DeadLetter:
    """The real rendering differs from the marked one: contents with edge whitespace left out
    (located byte for byte), or a dead letter."""
    edges = [0, *(x for span in spans for x in span), len(text)]
    scaffolding = [text[a:b] for a, b in zip(edges[::2], edges[1::2])]
    contents = [m.content for m in conv.messages]
    found = locate_trimmed(real, scaffolding, contents)
    if isinstance(found, str):
        where = _diff(text, real)
        detail = f"the rendering changes with the contents (first difference at {where}): {found}"
        return DeadLetter(rows.TEMPLATE_REWROTE, "messages", detail, side)
    located, removed = found
    return Rendering(real, located, removed_bytes(contents, removed))


def _first_missing(conv: Conversation, text: str, spans: list[tuple[int, int]]) -> int:
    """The first message whose content is not the next located span, in order."""
    j = 0
    for i, m in enumerate(conv.messages):
        if j < len(spans) and text[spans[j][0] : spans[j][1]] == m.content:
            j += 1
        else:
            return i
    return len(conv.messages) - 1


def _diff(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"char {i}: {a[i : i + 30]!r} vs {b[i : i + 30]!r}"
