"""Tokenize renderings: template control tokens by id, everything else by our tokenizer adapter.

A rendering is text in which the template wrote its control tokens as strings
(``<|im_start|>``, ``<start_of_turn>``, the BOS it was handed). The model was trained with those
strings as single special ids, as transformers' tokenizer splits them out before tokenizing the
rest. Our adapter never parses special tokens from text (data must not inject control tokens), so
this module does the split itself, and only where it is safe: control-token strings are searched
in the **scaffolding** only, never inside a message content, so a user who writes "<|im_end|>"
gets five plain tokens, not an end of turn. Each stretch of text between two control tokens
(scaffolding and contents together, as transformers sees it) goes through the adapter in one
batch call, which gives exact byte offsets; offsets are shifted into the rendering.

Which strings are control tokens: the tokenizer's special tokens whose text the template can
produce: those in the template source, the BOS / EOS handed to it, and those found in a probe
rendering (templates that build a token from pieces, ``'<|' + role + '|>'``). Gemma has 6,000+
special tokens; a matcher over only these few stays fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from pipelines.chat.backend import Tokenizer
from pipelines.chat.render import Rendering


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
class RenderedTokens:
    """One rendering, tokenized. Offsets are into the rendering (chars) / its UTF-8 (bytes)."""

    ids: np.ndarray  # int32 [n]
    offsets: np.ndarray  # int64 [n, 2] char offsets
    byte_offsets: np.ndarray  # int64 [n, 2]
    special: np.ndarray  # bool [n]: a control token split out of the scaffolding
    lossless: np.ndarray  # bool [n]: the token's stretch of text was tokenized losslessly
    span_bytes: np.ndarray  # int64 [n_messages, 2]: each content's byte span


def char_to_byte(text: str) -> np.ndarray:
    """int64 [len(text) + 1]: the UTF-8 byte position of every char position."""
    cp = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    width = 1 + (cp >= 0x80).astype(np.int64) + (cp >= 0x800) + (cp >= 0x10000)
    out = np.zeros(len(cp) + 1, dtype=np.int64)
    np.cumsum(width, out=out[1:])
    return out


def _split(r: Rendering, matcher: SpecialMatcher) -> list[tuple[int, int, int]]:
    """(start, end, id) of control tokens in the scaffolding of `r` (id -1: a text stretch)."""
    items: list[tuple[int, int, int]] = []
    pos = 0
    text = r.text
    bounds = [*r.spans.tolist(), [len(text), len(text)]]
    for a, b in bounds:  # scaffolding is [pos, a) before each content [a, b)
        if matcher.pattern is not None:
            for m in matcher.pattern.finditer(text, pos, a):
                items.append((m.start(), m.end(), matcher.ids[m.group()]))
        pos = max(pos, b)
    out: list[tuple[int, int, int]] = []
    at = 0
    for s, e, i in items:
        if s > at:
            out.append((at, s, -1))
        out.append((s, e, i))
        at = e
    if at < len(text):
        out.append((at, len(text), -1))
    return out


def encode_renderings(
    tokenizer: Tokenizer, matcher: SpecialMatcher, renderings: list[Rendering]
) -> list[RenderedTokens]:
    """Tokenize many renderings with one adapter call over all their text stretches."""
    layouts = [_split(r, matcher) for r in renderings]
    pieces = [r.text[s:e] for r, lay in zip(renderings, layouts) for s, e, i in lay if i < 0]
    enc = tokenizer.encode_batch(pieces) if pieces else None
    out = []
    p = 0
    for r, lay in zip(renderings, layouts):
        c2b = char_to_byte(r.text)
        ids, offs, boffs, spec, lossless = [], [], [], [], []
        for s, e, i in lay:
            if i >= 0:  # a control token: one id over its text
                ids.append(np.array([i], np.int32))
                offs.append(np.array([[s, e]], np.int64))
                boffs.append(np.array([[c2b[s], c2b[e]]], np.int64))
                spec.append(np.ones(1, bool))
                lossless.append(np.ones(1, bool))
                continue
            lo, hi = int(enc.row_splits[p]), int(enc.row_splits[p + 1])
            ids.append(enc.ids[lo:hi])
            offs.append(enc.offsets[lo:hi] + s)
            boffs.append(enc.byte_offsets[lo:hi] + c2b[s])
            spec.append(np.zeros(hi - lo, bool))
            lossless.append(np.full(hi - lo, bool(enc.lossless[p])))
            p += 1
        cat = np.concatenate
        out.append(
            RenderedTokens(
                cat(ids) if ids else np.zeros(0, np.int32),
                cat(offs) if offs else np.zeros((0, 2), np.int64),
                cat(boffs) if boffs else np.zeros((0, 2), np.int64),
                cat(spec) if spec else np.zeros(0, bool),
                cat(lossless) if lossless else np.zeros(0, bool),
                c2b[r.spans],
            )
        )
    return out
