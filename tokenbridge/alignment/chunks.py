"""Token alignment between two tokenizations of the same text, into the chunks of the shards.

A Numba walk over both sides' byte offsets, O(n + m) per row, cuts chunks only where both sides'
offsets can be trusted; a region with an untrusted token goes to the DP fallback
(`tokenbridge.alignment.dp`) and is counted, never silent. Special tokens get chunk -1 and are
paired by role, never by text (docs/alignment.md, "Chunks"; the chunk columns' contract:
`tokenbridge.formats.shard_schema`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tokenbridge.alignment.walk_kernel import ERR_NO_TABLE, LEN_CAP, META_SPECIAL, align_kernel

if TYPE_CHECKING:
    from tokenbridge.tokenizers import BatchEncoding, Encoding, Tokenizer

CHUNK_1_1, CHUNK_1_N, CHUNK_N_1, CHUNK_N_M = 0, 1, 2, 3  # student:teacher token counts
CHUNK_KIND_NAMES = ("1:1", "1:N", "N:1", "N:M")


class AlignmentError(ValueError):
    """A row that cannot be aligned (the message names the row and what is missing)."""


@dataclass(frozen=True)
class VocabBytes:
    """Token byte table of one vocabulary, packed for the kernels.

    offsets int64 [V + 1], data uint8: token t's bytes are data[offsets[t]:offsets[t + 1]];
    special bool [V]: control/added special tokens (no bytes, chunk -1); meta uint16 [V]: the
    byte length (capped at LEN_CAP) with META_SPECIAL set for specials, one compact table the
    per-token check reads (8-byte offsets for a 128k vocab miss the cache far more often).
    """

    offsets: np.ndarray
    data: np.ndarray
    special: np.ndarray
    meta: np.ndarray

    @property
    def size(self) -> int:
        return int(self.special.size)

    @staticmethod
    def from_pieces(pieces: list[bytes | None], special_ids=()) -> VocabBytes:
        lens = np.fromiter((len(p) if p is not None else 0 for p in pieces), np.int64, len(pieces))
        offsets = np.zeros(len(pieces) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        # a writable copy: Numba compiles read-only arrays (frombuffer) as a separate type
        data = np.frombuffer(b"".join(p for p in pieces if p is not None), np.uint8).copy()
        special = np.fromiter((p is None for p in pieces), np.bool_, len(pieces))
        for t in special_ids:
            if 0 <= t < special.size:
                special[t] = True
        meta = np.minimum(lens, LEN_CAP) | np.where(special, META_SPECIAL, 0)
        meta = meta.astype(np.uint16)
        return VocabBytes(offsets, data, special, meta)


_VOCAB_CACHE: dict[str, VocabBytes] = {}


def vocab_bytes(source: Tokenizer | VocabBytes | list[bytes | None]) -> VocabBytes:
    """The packed token byte table of a tokenizer (cached by fingerprint) or of a piece list."""
    if isinstance(source, VocabBytes):
        return source
    if isinstance(source, list | tuple):
        return VocabBytes.from_pieces(list(source))
    key = source.fingerprint
    if key not in _VOCAB_CACHE:
        _VOCAB_CACHE[key] = VocabBytes.from_pieces(
            source.token_bytes(), special_ids=source.all_special_ids
        )
    return _VOCAB_CACHE[key]


@dataclass(frozen=True, slots=True)
class Alignment:
    """One text, one (student, teacher) pair. Chunk ids are monotone and contiguous from 0.

    Beyond the per-token chunk ids (the shards' columns, see `tokenbridge/formats/shard_schema.py`), each chunk
    c records where it ends: chunk_student_end[c] / chunk_teacher_end[c] are the token indices
    one past it on each side, chunk_byte_end[c] the byte position in the text (-1 inside a
    DP-fallback region, where offsets are not trusted). Windows cut only at chunk ends with a
    known byte position.
    """

    student_chunk: np.ndarray  # int32 [n_s], -1 on special tokens
    teacher_chunk: np.ndarray  # int32 [n_t]
    n_chunks: int
    chunk_kind: np.ndarray  # int8 [C]
    chunk_exact: np.ndarray  # bool [C]
    used_fallback: bool
    chunk_student_end: np.ndarray | None = None  # int32 [C]
    chunk_teacher_end: np.ndarray | None = None  # int32 [C]
    chunk_byte_end: np.ndarray | None = None  # int64 [C]
    fallback_regions: int = 0
    dropped_tokens: int = 0  # plain tokens left at -1 because their chunk held a special token


@dataclass(frozen=True)
class BatchAlignment:
    """Flat alignment of a batch, as the kernel returns it (what batch consumers read).

    Chunk ids in student_chunk / teacher_chunk are per row (from 0 in every row); the per-chunk
    arrays are concatenated over rows, row b owning [chunk_splits[b], chunk_splits[b + 1]).
    """

    student_chunk: np.ndarray  # int32 [N_s]
    teacher_chunk: np.ndarray  # int32 [N_t]
    student_splits: np.ndarray  # int64 [B + 1]
    teacher_splits: np.ndarray  # int64 [B + 1]
    chunk_splits: np.ndarray  # int64 [B + 1]
    chunk_kind: np.ndarray  # int8 [C]
    chunk_exact: np.ndarray  # bool [C]
    chunk_student_end: np.ndarray  # int32 [C], row-relative token index
    chunk_teacher_end: np.ndarray  # int32 [C]
    chunk_byte_end: np.ndarray  # int64 [C], -1 = not a trusted text position
    fallback_regions: np.ndarray  # int32 [B]: DP-fallback regions per row
    dropped_tokens: np.ndarray  # int32 [B]: non-special tokens left at -1 (chunks with specials)
    row_error: np.ndarray  # int8 [B]: 0 = aligned

    def __len__(self) -> int:
        return int(self.row_error.size)

    def row(self, b: int) -> Alignment:
        return self._rows(b, b + 1)[0]

    def rows(self) -> list[Alignment]:
        return self._rows(0, len(self))

    def _rows(self, lo: int, hi: int) -> list[Alignment]:
        # plain Python ints and one pass: this runs once per document in the Beam job
        ss = self.student_splits[lo : hi + 1].tolist()
        ts = self.teacher_splits[lo : hi + 1].tolist()
        cs = self.chunk_splits[lo : hi + 1].tolist()
        fb = self.fallback_regions[lo:hi].tolist()
        dr = self.dropped_tokens[lo:hi].tolist()
        err = self.row_error[lo:hi].tolist()
        out = []
        for i in range(hi - lo):
            if err[i] == ERR_NO_TABLE:
                raise AlignmentError(
                    f"row {lo + i}: its offsets are untrusted or the row is not lossless, so it "
                    "needs the DP fallback, which needs both token byte tables (pass "
                    "student_bytes= and teacher_bytes=, e.g. the Tokenizer objects)"
                )
            c0, c1 = cs[i], cs[i + 1]
            out.append(
                Alignment(
                    self.student_chunk[ss[i] : ss[i + 1]],
                    self.teacher_chunk[ts[i] : ts[i + 1]],
                    c1 - c0,
                    self.chunk_kind[c0:c1],
                    self.chunk_exact[c0:c1],
                    fb[i] > 0,
                    self.chunk_student_end[c0:c1],
                    self.chunk_teacher_end[c0:c1],
                    self.chunk_byte_end[c0:c1],
                    fb[i],
                    dr[i],
                )
            )
        return out


_EMPTY_TAB = VocabBytes.from_pieces([])


def _ids(ids) -> np.ndarray:
    """Token ids as a contiguous int32 array (no copy for the adapter's int32 output)."""
    return np.ascontiguousarray(ids, np.int32)


def _table(source, ids: np.ndarray, side: str) -> VocabBytes | None:
    if source is None:
        return None
    tab = vocab_bytes(source)
    # one reduction: negative ids wrap to huge unsigned values
    if ids.size and int(ids.view(np.uint32).max()) >= tab.size:
        bad = int(ids[(ids < 0) | (ids >= tab.size)][0])
        raise AlignmentError(f"{side} token id {bad} is outside its byte table (size {tab.size})")
    return tab


def align_flat(
    *,
    student_ids: np.ndarray,
    student_byte_offsets: np.ndarray,
    student_splits: np.ndarray,
    teacher_ids: np.ndarray,
    teacher_byte_offsets: np.ndarray,
    teacher_splits: np.ndarray,
    student_lossless: np.ndarray | None = None,
    teacher_lossless: np.ndarray | None = None,
    student_bytes: Tokenizer | VocabBytes | list | None = None,
    teacher_bytes: Tokenizer | VocabBytes | list | None = None,
    force_fallback: bool = False,
) -> BatchAlignment:
    """Align a batch given flat arrays per side: ids [N], byte offsets [N, 2], splits [B + 1].

    student_bytes / teacher_bytes: the token byte tables (a Tokenizer, a VocabBytes or a
    `token_bytes()` list). Without them specials are not recognised and rows that need the DP
    fallback are reported in `row_error`. force_fallback: DP for every row (offsets ignored).
    """
    s_ids = _ids(student_ids)
    t_ids = _ids(teacher_ids)
    s_splits = np.ascontiguousarray(student_splits, np.int64)
    t_splits = np.ascontiguousarray(teacher_splits, np.int64)
    if s_splits.size != t_splits.size:
        raise AlignmentError(
            f"student batch has {s_splits.size - 1} rows, teacher batch {t_splits.size - 1}"
        )
    n_rows = s_splits.size - 1
    s_lossless = np.ones(n_rows, np.bool_) if student_lossless is None else student_lossless
    t_lossless = np.ones(n_rows, np.bool_) if teacher_lossless is None else teacher_lossless
    s_tab = _table(student_bytes, s_ids, "student")
    t_tab = _table(teacher_bytes, t_ids, "teacher")
    if force_fallback and (s_tab is None or t_tab is None):
        raise AlignmentError("force_fallback needs student_bytes and teacher_bytes")
    st = s_tab or _EMPTY_TAB
    tt = t_tab or _EMPTY_TAB
    tabs = (st.offsets, st.data, st.meta, tt.offsets, tt.data, tt.meta)
    res = align_kernel(
        s_ids,
        np.ascontiguousarray(student_byte_offsets, np.int64).reshape(-1, 2),
        s_splits,
        np.ascontiguousarray(s_lossless, np.bool_),
        t_ids,
        np.ascontiguousarray(teacher_byte_offsets, np.int64).reshape(-1, 2),
        t_splits,
        np.ascontiguousarray(t_lossless, np.bool_),
        tabs,
        (s_tab is not None, t_tab is not None),
        force_fallback,
    )
    s_chunk, t_chunk, c_splits, kind, exact, c_send, c_tend, c_bend, fallback, dropped, err = res
    return BatchAlignment(s_chunk, t_chunk, s_splits, t_splits, c_splits, kind, exact, c_send,
                          c_tend, c_bend, fallback, dropped, err)  # fmt: skip


def align_batch_flat(
    student: BatchEncoding,
    teacher: BatchEncoding,
    *,
    student_bytes=None,
    teacher_bytes=None,
    force_fallback: bool = False,
) -> BatchAlignment:
    """Align two BatchEncodings of the same texts in one kernel call; errors stay per row."""
    return align_flat(
        student_ids=student.ids,
        student_byte_offsets=student.byte_offsets,
        student_splits=student.row_splits,
        teacher_ids=teacher.ids,
        teacher_byte_offsets=teacher.byte_offsets,
        teacher_splits=teacher.row_splits,
        student_lossless=student.lossless,
        teacher_lossless=teacher.lossless,
        student_bytes=student_bytes,
        teacher_bytes=teacher_bytes,
        force_fallback=force_fallback,
    )


def align_batch(
    student: BatchEncoding,
    teacher: BatchEncoding,
    *,
    student_bytes=None,
    teacher_bytes=None,
    force_fallback: bool = False,
) -> list[Alignment]:
    """Per-row Alignments of a batch; raises AlignmentError naming the first row that failed."""
    return align_batch_flat(
        student,
        teacher,
        student_bytes=student_bytes,
        teacher_bytes=teacher_bytes,
        force_fallback=force_fallback,
    ).rows()


def align(
    student: Encoding,
    teacher: Encoding,
    *,
    student_bytes=None,
    teacher_bytes=None,
    force_fallback: bool = False,
) -> Alignment:
    """Align one text's student and teacher Encodings (docs/alignment.md, "Chunks")."""
    res = align_flat(
        student_ids=student.ids,
        student_byte_offsets=student.byte_offsets,
        student_splits=np.array([0, len(student.ids)]),
        teacher_ids=teacher.ids,
        teacher_byte_offsets=teacher.byte_offsets,
        teacher_splits=np.array([0, len(teacher.ids)]),
        student_lossless=np.array([student.lossless]),
        teacher_lossless=np.array([teacher.lossless]),
        student_bytes=student_bytes,
        teacher_bytes=teacher_bytes,
        force_fallback=force_fallback,
    )
    return res.row(0)
