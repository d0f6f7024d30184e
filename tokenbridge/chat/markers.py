"""Where each message sits among one side's tokens: its content tokens and its turn markers.

Which control ids open and close a turn is learnt once per template from a probe conversation,
with no table of known templates (docs/alignment.md, "Conversations"). Content tokens are those
whose bytes overlap the content; the *inside* ones lie wholly in it (a BPE merge of a content's
last "." with the template's "\\n\\n" overlaps but is not inside).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenbridge.chat.encode import RenderedBatch

TOKEN_SCAFFOLD, TOKEN_CONTENT, TOKEN_OPEN, TOKEN_CLOSE = 0, 1, 2, 3  # Layout.kind


@dataclass(frozen=True)
class TemplateMarkers:
    open_ids: np.ndarray  # int32: control tokens that open a turn
    close_ids: np.ndarray  # int32: control tokens that close one

    def tables(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """bool [vocab_size] lookups (is an open id, is a close id)."""
        is_open, is_close = np.zeros(vocab_size, bool), np.zeros(vocab_size, bool)
        is_open[self.open_ids], is_close[self.close_ids] = True, True
        return is_open, is_close

    def to_json(self, tokenizer) -> dict:
        name = tokenizer.special_content
        return {
            "open": [name(int(i)) for i in self.open_ids],
            "close": [name(int(i)) for i in self.close_ids],
        }


@dataclass(frozen=True)
class Layout:
    """One side of a batch of conversations, flat. Token ranges are [start, end) indices into
    the batch's flat token arrays (-1 = none), one row per message (RenderedBatch.span_splits).
    """

    message: np.ndarray  # int32 [N]: message index within its conversation, -1 between turns
    kind: np.ndarray  # int8 [N]: TOKEN_*
    content: np.ndarray  # int64 [M, 2]: tokens overlapping each content
    inside: np.ndarray  # int64 [M, 2]: tokens wholly inside each content
    open: np.ndarray  # int64 [M]: the open marker of message k's turn
    close: np.ndarray  # int64 [M, 2]: whitespace + close marker after message k


def token_ranges(tok: RenderedBatch, span_bytes: np.ndarray | None = None):
    """Per message: tokens overlapping the content, tokens inside it (see module docstring).

    span_bytes: int64 [M, 2] byte spans in each rendering to use instead of the contents' own
    (`tokenbridge.chat.pairs`: the part of a content both sides of a pair contain)."""
    g, span = tok.global_bytes()
    if span_bytes is not None:
        span = span_bytes + (span - tok.span_bytes)
    bs, be = g[:, 0], g[:, 1]
    s, e = span[:, 0], span[:, 1]
    row = np.repeat(np.arange(len(tok)), np.diff(tok.span_splits))
    lo, hi = tok.token_splits[row], tok.token_splits[row + 1]
    clip = lambda x: np.clip(x, lo, hi)  # noqa: E731  (zero-width tokens at a row's edge)
    o0 = clip(np.searchsorted(be, s, side="right"))  # first token ending after the start
    o1 = clip(np.searchsorted(bs, e, side="left"))  # first token starting at or after the end
    at = clip(np.searchsorted(bs, s, side="left"))
    empty = s == e
    o0 = np.where(empty, at, o0)
    o1 = np.where(empty, at, np.maximum(o1, o0))
    i0 = np.maximum(at, o0)
    i1 = np.maximum(np.minimum(clip(np.searchsorted(be, e, side="right")), o1), i0)
    return np.stack([o0, o1], axis=1), np.stack([i0, i1], axis=1)


def _gaps(tok: RenderedBatch, content: np.ndarray):
    """Gap g of rendering b lies before message g - b (or is the last gap of b): token ranges
    [g0, g1), the message before it (-1) and the message after it (-1)."""
    n_r, n_m = len(tok), content.shape[0]
    row = np.repeat(np.arange(n_r), np.diff(tok.span_splits))
    before = np.arange(n_m) + row  # the gap before message k
    last = tok.span_splits[1:] + np.arange(n_r)  # the last gap of each rendering
    first = tok.span_splits[:-1] + np.arange(n_r)
    g0 = np.empty(n_m + n_r, np.int64)
    g1 = np.empty(n_m + n_r, np.int64)
    prev = np.full(n_m + n_r, -1, np.int64)
    nxt = np.full(n_m + n_r, -1, np.int64)
    g1[before], g1[last] = content[:, 0], tok.token_splits[1:]
    g0[first] = tok.token_splits[:-1]
    g0[before + 1] = content[:, 1]
    prev[before + 1] = np.arange(n_m)
    nxt[before] = np.arange(n_m)
    return g0, g1, prev, nxt


def fill_ranges(starts: np.ndarray, ends: np.ndarray, values, out: np.ndarray) -> None:
    """out[starts[i]:ends[i]] = values[i] for non-overlapping ranges, no Python loop."""
    values = np.broadcast_to(values, starts.shape)
    keep = ends > starts
    starts, ends, values = starts[keep], ends[keep], values[keep]
    lens = ends - starts
    idx = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    idx += np.arange(int(lens.sum()))
    out[idx] = np.repeat(values, lens)


def layout(tok: RenderedBatch, markers: TemplateMarkers, tables) -> Layout:
    """Content tokens, turn markers and message ids of every conversation of a batch."""
    is_open_id, is_close_id = tables
    n, m = tok.ids.size, tok.span_bytes.shape[0]
    content, inside = token_ranges(tok)
    g0, g1, prev, nxt = _gaps(tok, content)
    # the close of the message before a gap: its first non-space token, if a close id
    nonspace = np.flatnonzero(tok.nonspace)
    f = nonspace[np.minimum(np.searchsorted(nonspace, g0), max(nonspace.size - 1, 0))]
    f = f if nonspace.size else np.full(g0.size, n)
    has_close = (prev >= 0) & (f < g1) & (f >= g0)
    has_close &= tok.special[np.minimum(f, n - 1)] & is_close_id[tok.ids[np.minimum(f, n - 1)]]
    close = np.full((m, 2), -1, np.int64)
    close[prev[has_close]] = np.stack([g0[has_close], f[has_close] + 1], axis=1)
    # the open of the message after a gap: the last open token in the gap, after the close
    after = np.where(has_close, f + 1, g0)
    opens = np.flatnonzero(tok.special & is_open_id[tok.ids])
    j = np.searchsorted(opens, g1, side="left") - 1
    cand = opens[np.maximum(j, 0)] if opens.size else np.full(g0.size, -1)
    has_open = (nxt >= 0) & (j >= 0) & (cand >= after) & (cand < g1)
    open_ = np.full(m, -1, np.int64)
    open_[nxt[has_open]] = cand[has_open]

    kind = np.zeros(n, np.int8)
    fill_ranges(content[:, 0], content[:, 1], TOKEN_CONTENT, kind)
    fill_ranges(close[:, 0], close[:, 1], TOKEN_CLOSE, kind)
    kind[open_[open_ >= 0]] = TOKEN_OPEN
    # message k runs from its open (or first content token) through its close (or content end)
    row = np.repeat(np.arange(len(tok)), np.diff(tok.span_splits))
    local = (np.arange(m) - tok.span_splits[row]).astype(np.int32)
    start = np.where(open_ >= 0, open_, content[:, 0])
    end = np.where(close[:, 1] >= 0, close[:, 1], content[:, 1])
    message = np.full(n, -1, np.int32)
    fill_ranges(start, end, local, message)
    return Layout(message, kind, content, inside, open_, close)


def markers_from_probe(tok: RenderedBatch, text: str) -> TemplateMarkers:
    """Learn open/close ids from a one-rendering probe whose messages alternate turns."""
    content, _ = token_ranges(tok)
    m, n = content.shape[0], tok.ids.size
    opens, closes = set(), set()
    for k in range(1, m + 1):
        g0 = int(content[k - 1, 1])
        g1 = int(content[k, 0]) if k < m else n
        after = g0
        for j in range(g0, g1):
            if tok.special[j]:
                if not tok.nonspace[g0:j].any():
                    closes.add(int(tok.ids[j]))
                    after = j + 1
                break
        if k < m:
            specials = np.flatnonzero(tok.special[after:g1])
            if specials.size:
                opens.add(int(tok.ids[after + specials[0]]))
    as_ids = lambda s: np.array(sorted(s), dtype=np.int32)  # noqa: E731
    return TemplateMarkers(as_ids(opens - closes), as_ids(closes))
