"""Tokenize renderings: template control tokens by id, everything else by our tokenizer adapter.

A rendering holds the template's control tokens as strings that the model saw as single ids,
but our adapter parses no special token from text. So the split is done here, in the
scaffolding only, never inside a content: a user who writes "<|im_end|>" gets plain tokens,
not an end of turn (docs/alignment.md, "Conversations").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from tokenbridge.chat.render import Rendering
from tokenbridge.tokenizers.adapter import Tokenizer


@dataclass(frozen=True)
class SpecialMatcher:
    pattern: re.Pattern | None  # longest first, so a token wins over the tokens inside it
    ids: dict[str, int]  # control-token text -> id

    @staticmethod
    def build(tokenizer: Tokenizer, texts: list[str]) -> SpecialMatcher:
        """Control tokens of `tokenizer` whose text occurs in any of `texts` (template source,
        probe renderings, BOS/EOS strings)."""
        ids: dict[str, int] = {}
        for i in sorted(tokenizer.all_special_ids):
            content = tokenizer.special_content(i)
            if content and content not in ids and any(content in t for t in texts):
                ids[content] = i
        if not ids:
            return SpecialMatcher(None, {})
        alternatives = sorted(ids, key=len, reverse=True)
        return SpecialMatcher(re.compile("|".join(map(re.escape, alternatives))), ids)


@dataclass(frozen=True)
class RenderedBatch:
    """Renderings, tokenized, flat: rendering b owns tokens [token_splits[b], token_splits[b+1])
    and contents [span_splits[b], span_splits[b+1]). Offsets are relative to each rendering
    (chars) and to its UTF-8 (bytes); byte_base[b] is where rendering b starts in the batch."""

    ids: np.ndarray  # int32 [N]
    offsets: np.ndarray  # int64 [N, 2] char offsets
    byte_offsets: np.ndarray  # int64 [N, 2]
    special: np.ndarray  # bool [N]: a control token split out of the scaffolding
    lossless: np.ndarray  # bool [N]: the token's stretch of text was tokenized losslessly
    nonspace: np.ndarray  # bool [N]: covers a byte other than ASCII whitespace
    token_splits: np.ndarray  # int64 [B + 1]
    span_bytes: np.ndarray  # int64 [M, 2]: each content's byte span in its rendering
    span_splits: np.ndarray  # int64 [B + 1]
    byte_base: np.ndarray  # int64 [B + 1]
    cut_bytes: np.ndarray  # int64 [M, 2]: edge whitespace the rendering left out (Rendering.cut)

    def __len__(self) -> int:
        return self.token_splits.size - 1

    def global_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """Token and content byte spans in batch coordinates (monotone over the batch)."""
        tok_row = np.repeat(np.arange(len(self)), np.diff(self.token_splits))
        span_row = np.repeat(np.arange(len(self)), np.diff(self.span_splits))
        return (
            self.byte_offsets + self.byte_base[tok_row, None],
            self.span_bytes + self.byte_base[span_row, None],
        )


_SPACE = np.zeros(256, bool)
_SPACE[list(b" \t\n\r\x0b\x0c")] = True


def _split(r: Rendering, matcher: SpecialMatcher) -> list[tuple[int, int, int]]:
    """(start, end, id) of the control tokens in the scaffolding of `r`, in order."""
    items: list[tuple[int, int, int]] = []
    if matcher.pattern is None:
        return items
    pos, text = 0, r.text
    for a, b in [*r.spans.tolist(), [len(text), len(text)]]:
        # scaffolding is [pos, a) before each content [a, b)
        items.extend((m.start(), m.end(), matcher.ids[m.group()])
                     for m in matcher.pattern.finditer(text, pos, a))  # fmt: skip
        pos = max(pos, b)
    return items


def _items(renderings: list[Rendering], matcher: SpecialMatcher):
    """Per item in order: rendering, char span, control id (-1: a text stretch); the texts."""
    it_r, it_s, it_e, it_id, pieces = [], [], [], [], []
    for ri, r in enumerate(renderings):
        at = 0
        for s, e, i in [*_split(r, matcher), (len(r.text), len(r.text), -2)]:
            if s > at:  # the text stretch before this control token
                it_r.append(ri), it_s.append(at), it_e.append(s), it_id.append(-1)
                pieces.append(r.text[at:s])
            if i >= 0:
                it_r.append(ri), it_s.append(s), it_e.append(e), it_id.append(i)
            at = e
    arr = lambda x: np.array(x, np.int64)  # noqa: E731
    return arr(it_r), arr(it_s), arr(it_e), np.array(it_id, np.int32), pieces


def encode_renderings(
    tokenizer: Tokenizer, matcher: SpecialMatcher, renderings: list[Rendering]
) -> RenderedBatch:
    """Tokenize many renderings with one adapter call over all their text stretches.

    Per rendering the items in order are text stretches (tokenized) and control tokens (one id
    each); the tokens of all items are laid out in flat arrays by numpy, no Python per token.
    """
    n_r = len(renderings)
    it_r, it_s, it_e, it_id, pieces = _items(renderings, matcher)
    # char -> byte positions of the whole batch at once (UTF-32 code points -> UTF-8 widths)
    joined = "".join(r.text for r in renderings)
    cp = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    c2b = np.zeros(cp.size + 1, np.int64)
    np.cumsum(1 + (cp >= 0x80).astype(np.int64) + (cp >= 0x800) + (cp >= 0x10000), out=c2b[1:])
    char_base = np.zeros(n_r + 1, np.int64)
    np.cumsum([len(r.text) for r in renderings], out=char_base[1:])
    byte_base = c2b[char_base]
    it_bs = c2b[char_base[it_r] + it_s] - byte_base[it_r]
    it_be = c2b[char_base[it_r] + it_e] - byte_base[it_r]

    is_text = it_id < 0
    enc = tokenizer.encode_batch(pieces) if pieces else None
    length = np.ones(it_id.size, np.int64)
    if enc is not None:
        length[is_text] = np.diff(enc.row_splits)
    start = np.zeros(it_id.size + 1, np.int64)
    np.cumsum(length, out=start[1:])
    n = int(start[-1])
    ids = np.empty(n, np.int32)
    offsets = np.empty((n, 2), np.int64)
    byte_offsets = np.empty((n, 2), np.int64)
    special = np.zeros(n, bool)
    lossless = np.ones(n, bool)
    ctl = ~is_text
    at = start[:-1][ctl]  # control tokens: one id over their own text
    ids[at] = it_id[ctl]
    offsets[at] = np.stack([it_s[ctl], it_e[ctl]], axis=1)
    byte_offsets[at] = np.stack([it_bs[ctl], it_be[ctl]], axis=1)
    special[at] = True
    if enc is not None and enc.ids.size:
        # token j of text stretch p goes to start[item of p] + (j - row_splits[p])
        counts = np.diff(enc.row_splits)
        item = np.flatnonzero(is_text)
        dest = np.repeat(start[:-1][item] - enc.row_splits[:-1], counts) + np.arange(enc.ids.size)
        ids[dest] = enc.ids
        offsets[dest] = enc.offsets + np.repeat(it_s[item], counts)[:, None]
        byte_offsets[dest] = enc.byte_offsets + np.repeat(it_bs[item], counts)[:, None]
        lossless[dest] = np.repeat(enc.lossless, counts)
    token_splits = start[np.searchsorted(it_r, np.arange(n_r + 1), side="left")]

    # a token is "space" when every byte it covers is ASCII whitespace (close-marker search)
    nonspace_byte = ~_SPACE[np.frombuffer(joined.encode("utf-8"), np.uint8)]
    cum = np.zeros(nonspace_byte.size + 1, np.int64)
    np.cumsum(nonspace_byte, out=cum[1:])
    tok_row = np.repeat(np.arange(n_r), np.diff(token_splits))
    g = byte_offsets + byte_base[tok_row, None]
    nonspace = (cum[g[:, 1]] - cum[g[:, 0]]) > 0

    spans = [r.spans for r in renderings]
    span_splits = np.zeros(n_r + 1, np.int64)
    np.cumsum([s.shape[0] for s in spans], out=span_splits[1:])
    span_chars = np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)
    span_row = np.repeat(np.arange(n_r), np.diff(span_splits))
    span_bytes = c2b[char_base[span_row, None] + span_chars] - byte_base[span_row, None]
    cuts = [np.zeros((s.shape[0], 2), np.int64) if r.cut is None else r.cut
            for r, s in zip(renderings, spans)]  # fmt: skip
    cut_bytes = np.concatenate(cuts) if cuts else np.zeros((0, 2), np.int64)
    return RenderedBatch(ids, offsets, byte_offsets, special, lossless, nonspace, token_splits,
                         span_bytes.reshape(-1, 2), span_splits, byte_base,
                         cut_bytes.astype(np.int64))  # fmt: skip
