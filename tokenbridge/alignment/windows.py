"""Training windows cut at the same character position for the student and every teacher.

The per-document reference of the rules (the align job cuts whole batches with them in Numba,
`tokenbridge.alignment.window_batch`, and the tests hold the two equal): each window ends on a
chunk boundary of every (student, teacher) pair, cut greedily, with BOS on every window and EOS
on the document's last (docs/alignment.md, "Windows").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenbridge.alignment.chunks import Alignment
    from tokenbridge.tokenizers import Encoding, Tokenizer


class WindowError(ValueError):
    """A document that cannot be cut (a chunk longer than a window, or inconsistent inputs)."""


@dataclass(frozen=True)
class Window:
    window: int
    char_start: int
    char_end: int
    text: str
    student_ids: np.ndarray  # int32, with the student's BOS/EOS convention
    teacher_ids: list[np.ndarray]  # per teacher, with that teacher's BOS/EOS
    teacher_chunk: list[np.ndarray]  # per teacher, -1 on specials
    teacher_student_chunk: list[np.ndarray]  # per teacher, chunk id of each student token
    teacher_n_chunks: list[int]


@dataclass(frozen=True)
class WindowConfig:
    max_student_tokens: int = 512
    max_teacher_tokens: int = 512
    stride_chars: int | None = None  # overlap; None = no overlap
    add_bos: bool = True
    add_eos: bool = True

    def __post_init__(self) -> None:
        for name in ("max_student_tokens", "max_teacher_tokens"):
            if getattr(self, name) < 3:
                raise ValueError(f"WindowConfig.{name} must be >= 3, got {getattr(self, name)}")
        if self.stride_chars is not None and self.stride_chars < 1:
            raise ValueError(f"WindowConfig.stride_chars must be >= 1, got {self.stride_chars}")


def _check_pair(al: Alignment, *, n_s: int, n_t: int, i: int) -> None:
    if al.chunk_byte_end is None or al.chunk_student_end is None or al.chunk_teacher_end is None:
        raise WindowError(f"teacher {i}: Alignment has no chunk ends; build it with align()")
    if al.student_chunk.size != n_s or al.teacher_chunk.size != n_t:
        raise WindowError(
            f"teacher {i}: Alignment covers {al.student_chunk.size}/{al.teacher_chunk.size} "
            f"student/teacher tokens, the encodings have {n_s}/{n_t}"
        )


def _pair_cuts(
    al: Alignment, *, n_s: int, n_t: int, n_bytes: int, i: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(byte positions, student index, teacher index) of every trusted chunk end of one pair,
    positions ascending and distinct, the text's start and end included."""
    _check_pair(al, n_s=n_s, n_t=n_t, i=i)
    ok = al.chunk_byte_end >= 0

    def with_ends(x: np.ndarray, first: int, last: int) -> np.ndarray:
        return np.concatenate([[first], x[ok], [last]]).astype(np.int64)

    pos = with_ends(al.chunk_byte_end, 0, n_bytes)
    s_idx = with_ends(al.chunk_student_end, 0, n_s)
    t_idx = with_ends(al.chunk_teacher_end, 0, n_t)
    # several entries at one byte (zero-width chunks, the text end): the LATER one wins
    uniq, first_from_end = np.unique(pos[::-1], return_index=True)
    keep = pos.size - 1 - first_from_end
    return uniq, s_idx[keep], t_idx[keep]


def _common_cuts(text_bytes: bytes, n_s: int, teachers) -> tuple[np.ndarray, np.ndarray, list]:
    """Byte positions cut by every pair, on character boundaries, with each side's token index."""
    pairs = [
        _pair_cuts(al, n_s=n_s, n_t=len(enc.ids), n_bytes=len(text_bytes), i=i)
        for i, (_, enc, al) in enumerate(teachers)
    ]
    pos = pairs[0][0]
    for p, _, _ in pairs[1:]:
        pos = np.intersect1d(pos, p, assume_unique=True)
    at = [np.searchsorted(p, pos) for p, _, _ in pairs]  # where each common position sits
    s_all = np.stack([s[j] for (_, s, _), j in zip(pairs, at)])  # [pairs, positions]
    n = len(text_bytes)
    arr = np.frombuffer(text_bytes, np.uint8)
    inside = pos < n
    on_char = pos <= n
    on_char[inside] = (arr[pos[inside]] & 0xC0) != 0x80  # not inside a UTF-8 character
    # pairs that disagree on the student token there (zero-width chunks) do not cut
    keep = on_char & (s_all == s_all[0]).all(axis=0)
    t_idx = [t[j][keep] for (_, _, t), j in zip(pairs, at)]
    return pos[keep], s_all[0][keep], t_idx


def _char_index(text: str, text_bytes: bytes, pos: np.ndarray) -> np.ndarray:
    if len(text_bytes) == len(text):  # ASCII: bytes are characters
        return pos
    starts = (np.frombuffer(text_bytes, np.uint8) & 0xC0) != 0x80
    before = np.concatenate([[0], np.cumsum(starts)])
    return before[pos]


def _furthest(idx: np.ndarray, a: int, budget: int) -> int:
    """Largest k with idx[k] - idx[a] <= budget (idx non-decreasing)."""
    return int(np.searchsorted(idx, idx[a] + budget, side="right")) - 1


def _renumber(chunk: np.ndarray, lo: int) -> np.ndarray:
    return np.where(chunk >= 0, chunk - lo, -1).astype(np.int32)


def _with_specials(body: np.ndarray, bos: int | None, eos: int | None) -> np.ndarray:
    head = [bos] if bos is not None else []
    tail = [eos] if eos is not None else []
    return np.concatenate([np.array(head, np.int32), body, np.array(tail, np.int32)])


@dataclass(frozen=True)
class CutPoints:
    """Where a document may be cut: positions shared by every pair, first 0, last the text end."""

    chars: np.ndarray  # int64 [K + 1], character positions, increasing
    student: np.ndarray  # int64 [K + 1], student token index at each cut
    teachers: list[np.ndarray]  # per teacher, int64 [K + 1]


def cut_points(
    text: str,
    *,
    student: tuple[Tokenizer, Encoding],
    teachers: list[tuple[Tokenizer, Encoding, Alignment]],
) -> CutPoints:
    """The cut points of one document (docs/alignment.md, "Windows")."""
    if not teachers:
        raise WindowError("cutting windows needs at least one teacher")
    text_bytes = text.encode("utf-8")
    pos, s_idx, t_idx = _common_cuts(text_bytes, len(student[1].ids), teachers)
    return CutPoints(_char_index(text, text_bytes, pos), s_idx, t_idx)


def _whole_document(
    text, n_s: int, teachers, *, config: WindowConfig, specials
) -> CutPoints | None:
    """The cut points [start, end] when the whole document fits one window, else None.

    Most documents of a corpus of short texts fit: skipping the common-boundary search for them
    halves the window stage. The greedy cut would take exactly this one window: every side fits
    with its BOS and EOS, and the start is a cut of every pair (no zero-width chunk ends at byte
    0 and shifts a pair's start index; then the full search decides). ``specials``: per side
    (student first) the (BOS, EOS) ids that will be added, None = none.
    """
    sizes = [n_s] + [len(enc.ids) for _, enc, _ in teachers]
    limits = [config.max_student_tokens] + [config.max_teacher_tokens] * len(teachers)
    for n, limit, pair in zip(sizes, limits, specials):
        if n + sum(x is not None for x in pair) > limit:
            return None
    for i, (_, enc, al) in enumerate(teachers):
        _check_pair(al, n_s=n_s, n_t=len(enc.ids), i=i)
        if bool((al.chunk_byte_end == 0).any()):
            return None
    ends = [np.array([0, n], np.int64) for n in sizes]
    return CutPoints(np.array([0, len(text)], np.int64), ends[0], ends[1:])


def cut_windows(
    text: str,
    *,
    student: tuple[Tokenizer, Encoding],
    teachers: list[tuple[Tokenizer, Encoding, Alignment]],
    config: WindowConfig,
) -> list[Window]:
    """Cut one document into windows (docs/alignment.md, "Windows"); [] for a text with no
    tokens."""
    s_tok, s_enc = student
    if not teachers:
        raise WindowError("cut_windows needs at least one teacher")
    if len(s_enc.ids) == 0 and all(len(enc.ids) == 0 for _, enc, _ in teachers):
        return []
    s_bos = s_tok.bos_id if config.add_bos else None
    s_eos = s_tok.eos_id if config.add_eos else None
    t_bos = [t.bos_id if config.add_bos else None for t, _, _ in teachers]
    t_eos = [t.eos_id if config.add_eos else None for t, _, _ in teachers]
    specials = [(s_bos, s_eos), *zip(t_bos, t_eos)]
    cuts = _whole_document(text, len(s_enc.ids), teachers, config=config, specials=specials)
    if cuts is None:
        cuts = cut_points(text, student=student, teachers=teachers)
    chars, s_idx, t_idx = cuts.chars, cuts.student, cuts.teachers
    last = len(chars) - 1
    # each side: (boundary token indices, room for the text's tokens, room in the last window)
    sides = [(s_idx, config.max_student_tokens - (s_bos is not None), s_eos is not None)]
    sides += [
        (t_idx[i], config.max_teacher_tokens - (t_bos[i] is not None), t_eos[i] is not None)
        for i in range(len(teachers))
    ]
    windows: list[Window] = []
    a = 0
    while a < last:
        k = min(_furthest(idx, a, room) for idx, room, _ in sides)
        if k >= last:
            k = last
            if any(idx[last] - idx[a] + eos > room for idx, room, eos in sides):
                k = last - 1
        if k <= a:
            need = [int(idx[a + 1] - idx[a]) for idx, _, _ in sides]
            raise WindowError(
                f"characters [{int(chars[a])}, {int(chars[a + 1])}) cannot be cut: the next "
                f"common chunk boundary needs {need[0]} student / {need[1:]} teacher tokens "
                f"(limits {config.max_student_tokens} / {config.max_teacher_tokens}, "
                "BOS/EOS included)"
            )
        windows.append(
            _make_window(
                text,
                s_enc,
                teachers,
                w=len(windows),
                span=(a, k),
                cuts=cuts,
                s_special=(s_bos, s_eos if k == last else None),
                t_special=[(b, e if k == last else None) for b, e in zip(t_bos, t_eos)],
            )
        )
        if k == last:
            break
        nxt = k
        if config.stride_chars is not None:
            want = int(chars[a]) + config.stride_chars
            nxt = min(k, max(a + 1, int(np.searchsorted(chars, want, side="left"))))
        a = nxt
    return windows


def _make_window(text, s_enc, teachers, *, w, span, cuts: CutPoints, s_special, t_special):
    """Window w over cut points span = (a, k); *_special: (BOS, EOS) ids to add, None = none."""
    a, k = span
    chars, s_idx, t_idx = cuts.chars, cuts.student, cuts.teachers
    s_lo, s_hi = int(s_idx[a]), int(s_idx[k])
    s_body = np.asarray(s_enc.ids[s_lo:s_hi], np.int32)
    teacher_ids, teacher_chunk, teacher_student_chunk, n_chunks = [], [], [], []
    for i, (_, enc, al) in enumerate(teachers):
        t_lo, t_hi = int(t_idx[i][a]), int(t_idx[i][k])
        sc = al.student_chunk[s_lo:s_hi]
        tc = al.teacher_chunk[t_lo:t_hi]
        live = sc[sc >= 0]
        lo = int(live.min()) if live.size else 0
        count = int(live.max()) - lo + 1 if live.size else 0
        bos, eos = t_special[i]
        pad = (bos is not None, eos is not None)
        teacher_ids.append(_with_specials(np.asarray(enc.ids[t_lo:t_hi], np.int32), bos, eos))
        teacher_chunk.append(_pad(_renumber(tc, lo), pad))
        s_pad = (s_special[0] is not None, s_special[1] is not None)
        teacher_student_chunk.append(_pad(_renumber(sc, lo), s_pad))
        n_chunks.append(count)
    c0, c1 = int(chars[a]), int(chars[k])
    return Window(
        window=w,
        char_start=c0,
        char_end=c1,
        text=text[c0:c1],
        student_ids=_with_specials(s_body, *s_special),
        teacher_ids=teacher_ids,
        teacher_chunk=teacher_chunk,
        teacher_student_chunk=teacher_student_chunk,
        teacher_n_chunks=n_chunks,
    )


def _pad(chunk: np.ndarray, pad: tuple[bool, bool]) -> np.ndarray:
    head = np.full(int(pad[0]), -1, np.int32)
    tail = np.full(int(pad[1]), -1, np.int32)
    return np.concatenate([head, chunk, tail])
