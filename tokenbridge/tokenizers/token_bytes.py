"""The bytes behind tokens, and exact offsets computed from them.

Tokenizers spell bytes differently (byte-level ``Ġ``, SentencePiece ``▁`` and ``<0xNN>``), and
every comparison of two vocabularies needs the bytes, never the spelling: they are computed
once per vocabulary here. Where a row's token bytes concatenate to the text, its offsets are
cumulative byte lengths, numpy over the whole batch (per-token tuples put the garbage collector
in charge).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit

SPACE_MARK = "\u2581"  # "▁", SentencePiece's spelling of a space


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """Stand-in character -> byte, for byte-level BPE spellings (GPT-2's printable alphabet).

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 (control
    characters, space, 0x7F-0xA0, 0xAD) are shifted to code points 256 and up, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    decoder = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if chr(b) not in decoder:
            decoder[chr(256 + shifted)] = b
            shifted += 1
    return decoder


def byte_level_bytes(piece: str) -> bytes | None:
    """Bytes of a byte-level BPE piece, or None if it uses characters outside the alphabet."""
    table = byte_level_decoder()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:
        return None


def metaspace_bytes(piece: str, *, byte_fallback: bool) -> bytes:
    """Bytes of a SentencePiece-style piece: ``▁`` is a space, ``<0xNN>`` one raw byte."""
    if byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(SPACE_MARK, " ").encode("utf-8")


def fingerprint(token_bytes: list[bytes | None], specials: dict[int, str]) -> str:
    """sha256 over (id, kind, payload) for every id: the vocabulary, independent of its spelling.

    Two loaders of the same vocabulary (a GGUF and the HF directory converted from it, a
    SentencePiece model and its GGUF) give the same fingerprint because both reduce to bytes.
    """
    h = hashlib.sha256(b"tokenbridge-vocab-v1")
    for i, b in enumerate(token_bytes):
        if b is not None:
            kind, payload = b"b", b
        elif i in specials:
            kind, payload = b"s", specials[i].encode("utf-8")
        else:
            kind, payload = b"-", b""
        h.update(struct.pack("<IcI", i, kind, len(payload)))
        h.update(payload)
    return h.hexdigest()


@dataclass(frozen=True)
class VocabTable:
    """Token bytes packed for numpy gathers: token i is flat[start[i] : start[i] + length[i]].

    length is -1 for ids without bytes (special tokens and unused ids).
    """

    length: np.ndarray  # int64 [V]
    start: np.ndarray  # int64 [V]
    flat: np.ndarray  # uint8 [sum of lengths]

    @staticmethod
    def build(token_bytes: list[bytes | None]) -> VocabTable:
        length = np.array([-1 if b is None else len(b) for b in token_bytes], dtype=np.int64)
        clipped = np.maximum(length, 0)
        start = np.cumsum(clipped) - clipped
        flat = np.frombuffer(b"".join(b for b in token_bytes if b is not None), dtype=np.uint8)
        return VocabTable(length=length, start=start, flat=flat)


@dataclass(frozen=True)
class TextBytes:
    """The UTF-8 of a batch of texts, concatenated, with maps between byte and character positions.

    Positions here are global (into the concatenation); rows are contiguous, so a row's local
    position is the global one minus the row's base.
    """

    buf: np.ndarray  # uint8 [total bytes]
    byte_base: np.ndarray  # int64 [B + 1]
    char_base: np.ndarray  # int64 [B + 1]
    is_start: np.ndarray  # bool [total bytes + 1], True where a character starts (and at the end)
    chars_before: np.ndarray  # int64 [total bytes + 1], characters starting before each byte
    char_start_byte: np.ndarray  # int64 [total chars + 1], byte where each character starts

    @staticmethod
    def build(texts: list[str]) -> TextBytes:
        encoded = [t.encode("utf-8") for t in texts]
        buf = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
        byte_base = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        is_start = np.ones(len(buf) + 1, dtype=bool)
        is_start[:-1] = (buf & 0xC0) != 0x80  # continuation bytes are 10xxxxxx
        chars_before = np.concatenate([[0], np.cumsum(is_start[:-1])]).astype(np.int64)
        char_start_byte = np.flatnonzero(is_start).astype(np.int64)
        return TextBytes(
            buf=buf,
            byte_base=byte_base,
            char_base=chars_before[byte_base],
            is_start=is_start,
            chars_before=chars_before,
            char_start_byte=char_start_byte,
        )

    def bytes_to_chars(self, start_g: np.ndarray, end_g: np.ndarray) -> tuple[np.ndarray, ...]:
        """Global byte spans -> global char spans; a span cutting a character widens to cover it."""
        start_c = self.chars_before[start_g] - (~self.is_start[start_g])
        end_c = self.chars_before[end_g]
        return start_c, end_c

    def chars_to_bytes(self, char_g: np.ndarray) -> np.ndarray:
        return self.char_start_byte[char_g]


def check_offsets(offsets: np.ndarray, text: str) -> tuple[str | None, np.ndarray]:
    """(why these char offsets cannot locate the tokens in `text` or None, uncovered chars).

    Offsets must lie inside the text, start <= end, starts non-decreasing. Non-whitespace
    characters in no token's span are returned: the caller decides whether the tokenizer dropped
    them (lossy, allowed: e.g. a byte-level vocabulary without a token for that byte) or the
    offsets fail to describe where tokens came from (a normalizer rewriting the text).
    """
    n = len(text)
    none = np.zeros(0, dtype=np.int64)
    if len(offsets) == 0:
        return None, np.flatnonzero([not ch.isspace() for ch in text]).astype(np.int64)
    s, e = offsets[:, 0], offsets[:, 1]
    if s.min() < 0 or e.max() > n or (e < s).any():
        return f"offsets outside [0, {n}] or reversed", none
    if (np.diff(s) < 0).any():
        return "token start offsets decrease", none
    cover = np.zeros(n + 1, dtype=np.int64)
    np.add.at(cover, s, 1)
    np.add.at(cover, e, -1)
    covered = np.cumsum(cover[:-1]) > 0
    content = np.fromiter((not ch.isspace() for ch in text), dtype=bool, count=n)
    return None, np.flatnonzero(content & ~covered)


@njit(cache=True, nogil=True)
def batch_offsets(
    ids, row_splits, buf, byte_base, prefix, keep, length, start, flat, offsets, byte_offsets, fast
):
    """Exact offsets of a whole batch in one pass (`Tokenizer.encode_batch`'s fast path): per row,
    the byte stream the tokens must reassemble (a dummy-prefix space, then the text's bytes minus
    those a byte-level vocabulary drops), the tokens walked over it comparing their bytes, and
    where every byte matches, byte and character offsets from the running position.

    Fills offsets / byte_offsets (int64 [N, 2], zeros on entry) of the rows whose token bytes
    reassemble their stream; fast[b] (bool [B]) says which did. Returns per row the text bytes
    the stream leaves out (int64 [B]).

    ids int32 [N] (all in range), row_splits int64 [B + 1], buf uint8: the texts' UTF-8 joined,
    byte_base int64 [B + 1], prefix int64 [B]: 1 where the tokenizer invents a leading space,
    keep bool [256]: the bytes the tokenizer keeps (all of them unless byte-level and missing
    some), length / start / flat: `VocabTable` (length -1: no bytes, i.e. special or unused).
    A zero-length token gets [0, 0); the invented space covers no text.
    """
    n_rows = len(row_splits) - 1
    longest = 0
    for b in range(n_rows):
        longest = max(longest, byte_base[b + 1] - byte_base[b])
    stream = np.empty(longest + 1, np.uint8)
    src = np.empty(longest + 1, np.int64)  # the text byte each stream byte stands for, -1: none
    chars_before = np.empty(longest + 1, np.int64)
    dropped = np.zeros(n_rows, np.int64)
    for b in range(n_rows):
        base, n_bytes = byte_base[b], byte_base[b + 1] - byte_base[b]
        n = 0
        if prefix[b]:
            stream[0] = 0x20
            src[0] = -1
            n = 1
        for x in range(n_bytes):
            c = buf[base + x]
            if keep[c]:
                stream[n] = c
                src[n] = x
                n += 1
        dropped[b] = n_bytes - (n - prefix[b])
        lo, hi = row_splits[b], row_splits[b + 1]
        pos, ok = 0, True
        for k in range(lo, hi):
            t = ids[k]
            m = length[t]
            if m < 0 or pos + m > n:
                ok = False
                break
            s = start[t]
            for j in range(m):
                if flat[s + j] != stream[pos + j]:
                    ok = False
                    break
            if not ok:
                break
            pos += m
        fast[b] = ok and pos == n
        if not fast[b]:
            continue
        count = 0
        for x in range(n_bytes):
            chars_before[x] = count
            count += (buf[base + x] & 0xC0) != 0x80  # continuation bytes are 10xxxxxx
        chars_before[n_bytes] = count
        pos = 0
        for k in range(lo, hi):
            m = length[ids[k]]
            if m == 0:
                continue
            first, last = src[pos], src[pos + m - 1]
            bs = first if first >= 0 else 0
            be = last + 1 if last >= 0 else 0
            byte_offsets[k, 0] = bs
            byte_offsets[k, 1] = be
            # a span that starts inside a character widens to cover it
            cut = bs < n_bytes and (buf[base + bs] & 0xC0) == 0x80
            offsets[k, 0] = chars_before[bs] - cut
            offsets[k, 1] = chars_before[be]
            pos += m
    return dropped
