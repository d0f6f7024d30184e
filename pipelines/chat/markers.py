"""Where each message sits among one side's tokens: its content tokens and its turn markers.

Turn markers are a template's control tokens that open a turn (``<|im_start|>``,
``<start_of_turn>``, ``<|start_header_id|>``, Phi-3's ``<|user|>``) and close one (``<|im_end|>``,
``<end_of_turn>``, ``<|eot_id|>``, an EOS). Which ids play which part is learnt once per template
from a probe conversation (system, user, assistant, user, assistant): in the scaffolding between
two contents, the first control token after the content (only whitespace before it) closes the
turn, and the first control token after that opens the next one. No table of known templates.

In a real conversation, the scaffolding *gap* before message k (after content k-1) holds:

- the *close* of message k-1: the whitespace-then-close-token run that starts the gap, if any;
- the *open* of message k: the last open token in the gap, if any (the last: SmolLM2's gap 0
  also holds a whole injected system turn, whose open token is not message 0's).

A message folded into another's turn (Gemma's system text opens the first user turn) has no
open or close of its own there. Tokens of message k (`Layout.message`) run from its open (or its
first content token) through its close (or its last content token); role headers belong to it,
separators between turns, BOS and injected text to no message (-1).

Content tokens are those whose bytes overlap the content; the *inside* ones lie wholly in it.
A token that also covers scaffolding (a BPE merge of a content's last "." with the template's
"\\n\\n") overlaps but is not inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipelines.chat.encode import RenderedTokens

TOKEN_SCAFFOLD, TOKEN_CONTENT, TOKEN_OPEN, TOKEN_CLOSE = 0, 1, 2, 3  # Layout.kind


@dataclass(frozen=True)
class TemplateMarkers:
    open_ids: np.ndarray  # int32: control tokens that open a turn
    close_ids: np.ndarray  # int32: control tokens that close one

    def to_json(self, tokenizer) -> dict:
        name = tokenizer.special_content
        return {
            "open": [name(int(i)) for i in self.open_ids],
            "close": [name(int(i)) for i in self.close_ids],
        }


@dataclass(frozen=True)
class Layout:
    """One side of one conversation; token ranges are [start, end) indices, -1 = none."""

    message: np.ndarray  # int32 [n]: message index of each token, -1 = between turns
    kind: np.ndarray  # int8 [n]: TOKEN_*
    content: np.ndarray  # int64 [m, 2]: tokens overlapping each content
    inside: np.ndarray  # int64 [m, 2]: tokens wholly inside each content
    open: np.ndarray  # int64 [m]: the open marker of message k's turn
    close: np.ndarray  # int64 [m, 2]: whitespace + close marker after message k


def _gap_close(tok: RenderedTokens, text: str, g0: int, g1: int, close_ids) -> int:
    """One past the close marker that starts gap [g0, g1), or -1."""
    for k in range(g0, g1):
        if tok.special[k]:
            return k + 1 if tok.ids[k] in close_ids else -1
        a, b = tok.offsets[k]
        if not text[a:b].isspace():
            return -1
    return -1


def _ranges(tok: RenderedTokens) -> tuple[np.ndarray, np.ndarray]:
    """Per message: tokens overlapping the content, tokens inside it (see module docstring)."""
    bs, be = tok.byte_offsets[:, 0], tok.byte_offsets[:, 1]
    s, e = tok.span_bytes[:, 0], tok.span_bytes[:, 1]
    o0 = np.searchsorted(be, s, side="right")  # first token ending after the content starts
    o1 = np.searchsorted(bs, e, side="left")  # first token starting at or after its end
    empty = s == e
    at = np.searchsorted(bs, s, side="left")
    o0 = np.where(empty, at, o0)
    o1 = np.where(empty, at, np.maximum(o1, o0))
    i0 = np.maximum(np.searchsorted(bs, s, side="left"), o0)
    i1 = np.maximum(np.minimum(np.searchsorted(be, e, side="right"), o1), i0)
    return np.stack([o0, o1], axis=1), np.stack([i0, i1], axis=1)


def layout(tok: RenderedTokens, text: str, markers: TemplateMarkers) -> Layout:
    n, m = tok.ids.size, tok.span_bytes.shape[0]
    content, inside = _ranges(tok)
    open_ = np.full(m, -1, np.int64)
    close = np.full((m, 2), -1, np.int64)
    kind = np.zeros(n, np.int8)
    message = np.full(n, -1, np.int32)
    is_open = tok.special & np.isin(tok.ids, markers.open_ids)
    for k in range(m + 1):  # gap k: after content k-1, before content k
        g0 = int(content[k - 1, 1]) if k else 0
        g1 = int(content[k, 0]) if k < m else n
        after = g0
        if k:
            end = _gap_close(tok, text, g0, g1, markers.close_ids)
            if end >= 0:
                close[k - 1] = (g0, end)
                kind[g0:end] = TOKEN_CLOSE
                after = end
        if k < m:
            hits = np.flatnonzero(is_open[after:g1])
            if hits.size:
                open_[k] = after + hits[-1]
                kind[open_[k]] = TOKEN_OPEN
    for k in range(m):
        c0, c1 = content[k]
        kind[c0:c1] = TOKEN_CONTENT
        start = open_[k] if open_[k] >= 0 else c0
        end = close[k, 1] if close[k, 1] >= 0 else c1
        message[start:end] = k
    return Layout(message, kind, content, inside, open_, close)


def markers_from_probe(tok: RenderedTokens, text: str) -> TemplateMarkers:
    """Learn open/close ids from a probe rendering whose messages alternate turns."""
    content, _ = _ranges(tok)
    m, n = content.shape[0], tok.ids.size
    opens, closes = set(), set()
    for k in range(1, m + 1):
        g0 = int(content[k - 1, 1])
        g1 = int(content[k, 0]) if k < m else n
        after = g0
        for j in range(g0, g1):
            if tok.special[j]:
                a, b = tok.offsets[g0:j, 0], tok.offsets[g0:j, 1]
                if all(text[x:y].isspace() for x, y in zip(a.tolist(), b.tolist())):
                    closes.add(int(tok.ids[j]))
                    after = j + 1
                break
        if k < m:
            specials = np.flatnonzero(tok.special[after:g1])
            if specials.size:
                opens.add(int(tok.ids[after + specials[0]]))
    as_ids = lambda s: np.array(sorted(s), dtype=np.int32)  # noqa: E731
    return TemplateMarkers(as_ids(opens - closes), as_ids(closes))
