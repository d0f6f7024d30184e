"""Long documents in bounded pieces, so that memory does not grow with a document's length.

Each piece carries on where the previous one stopped, with enough leading context that every
tokenizer sees the seam as in the whole document, and keeps only the windows that end far enough
before its own end; the windows then equal the whole document's wherever the tokenizers are
local within the overlap (docs/alignment.md, "Long documents").
"""

from __future__ import annotations

from dataclasses import dataclass

_BREAKS = ("\n", " ", "\t", "\r")  # where a piece may end or start, best first


@dataclass(frozen=True)
class PieceConfig:
    piece_chars: int = 1 << 20  # documents longer than this are cut in pieces of this size
    overlap_chars: int = 4096  # context each side of a seam

    def __post_init__(self) -> None:
        if self.overlap_chars < 1:
            raise ValueError(f"overlap_chars must be >= 1, got {self.overlap_chars}")
        if self.piece_chars < 8 * self.overlap_chars:
            raise ValueError(
                f"piece_chars ({self.piece_chars}) must be >= 8 x overlap_chars "
                f"({self.overlap_chars}), or pieces would be mostly overlap"
            )


@dataclass(frozen=True)
class Piece:
    """Characters [start, end) of a document; windows from `cut_from`, final up to `final_to`."""

    index: int
    start: int
    end: int
    cut_from: int
    final_to: int
    last: bool


def break_before(text: str, lo: int, hi: int) -> int:
    """A position in [lo, hi] just after a newline (else a space, tab, CR) in text[lo:hi]; hi if
    there is none (then the piece boundary cuts a word, which the overlap absorbs)."""
    lo = max(lo, 0)
    for sep in _BREAKS:
        i = text.rfind(sep, lo, hi)
        if i >= 0:
            return i + 1
    return hi


def plan_piece(text: str, cut_from: int, config: PieceConfig, *, index: int, size: int) -> Piece:
    """The piece whose windows start at `cut_from`; `size` may exceed piece_chars when a
    piece kept no window (a stretch of text with very long windows)."""
    n, ov = len(text), config.overlap_chars
    start = 0 if cut_from <= ov else break_before(text, cut_from - 2 * ov, cut_from - ov)
    if start + size >= n:
        return Piece(index, start, n, cut_from, n, True)
    end = break_before(text, max(cut_from + 4 * ov, start + size // 2), start + size)
    return Piece(index, start, end, cut_from, end - ov, False)


class PieceWalk:
    """The pieces of one document, in order. After each piece the caller reports where the next
    window starts (`advance`); a piece that kept nothing makes the next one twice as long."""

    def __init__(self, text: str, config: PieceConfig):
        self.text, self.config = text, config
        self.cut_from, self.size, self.index = 0, config.piece_chars, 0
        self.finished = False
        self._pending: Piece | None = None

    def __iter__(self):
        while not self.finished:
            piece = plan_piece(
                self.text, self.cut_from, self.config, index=self.index, size=self.size
            )
            self._pending = piece
            yield piece
            if self._pending is not None:
                raise RuntimeError("PieceWalk: advance() was not called after a piece")

    def advance(self, next_start: int | None) -> None:
        """next_start: document position of the first window not kept (None: no more)."""
        piece, self._pending = self._pending, None
        self.index += 1
        if piece.last or next_start is None:
            self.finished = True
            return
        if next_start <= self.cut_from:
            self.size *= 2  # no window was final in this piece: look further
            return
        self.cut_from, self.size = next_start, self.config.piece_chars
