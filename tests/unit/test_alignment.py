"""Alignment on hand-made tokenizations: chunk kinds, specials, empty text, broken offsets.

A tiny vocabulary of byte pieces stands in for a tokenizer so each case states exactly which
spans the aligner sees; the property tests over real tokenizers live in
test_alignment_properties.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tokenbridge.alignment import (
    CHUNK_1_1,
    CHUNK_1_N,
    CHUNK_N_1,
    CHUNK_N_M,
    AlignmentError,
    VocabBytes,
    align,
    align_batch,
    align_batch_flat,
)
from tokenbridge.tokenizers import BatchEncoding, Encoding

# one shared toy vocabulary: id -> bytes (None = special token)
PIECES = [None, None, b"a", b"b", b"ab", b"c", b"bc", b"abc", b" ", b" a", b"d", b"cd", b"\xc3\xa9"]
BOS, EOS = 0, 1
VOCAB = VocabBytes.from_pieces(PIECES)
ID = {p: i for i, p in enumerate(PIECES) if p is not None}


def enc(pieces: list[bytes | None], *, offsets=None, lossless=True) -> Encoding:
    """Encoding of a piece list; byte offsets are cumulative unless given (specials: zero width)."""
    ids = np.array([ID[p] if isinstance(p, bytes) else p for p in pieces], np.int32)
    if offsets is None:
        ends = np.cumsum([len(PIECES[i] or b"") for i in ids], dtype=np.int64)
        offsets = np.stack([ends - [len(PIECES[i] or b"") for i in ids], ends], axis=1)
    bo = np.asarray(offsets, np.int64).reshape(-1, 2)
    return Encoding(ids=ids, offsets=bo.copy(), byte_offsets=bo, lossless=lossless)


def run(s, t, **kw):
    kw.setdefault("student_bytes", VOCAB)
    kw.setdefault("teacher_bytes", VOCAB)
    return align(s, t, **kw)


def test_one_to_one_identical_pieces_are_exact():
    al = run(enc([b"ab", b"c"]), enc([b"ab", b"c"]))
    assert al.n_chunks == 2 and not al.used_fallback
    assert al.student_chunk.tolist() == [0, 1] and al.teacher_chunk.tolist() == [0, 1]
    assert al.chunk_kind.tolist() == [CHUNK_1_1, CHUNK_1_1]
    assert al.chunk_exact.tolist() == [True, True]
    assert al.chunk_byte_end.tolist() == [2, 3]


def test_every_chunk_kind():
    cases = {
        CHUNK_1_N: ([b"abc"], [b"a", b"bc"]),
        CHUNK_N_1: ([b"a", b"b", b"c"], [b"abc"]),
        CHUNK_N_M: ([b"ab", b"cd"], [b"a", b"bc", b"d"]),
        CHUNK_1_1: ([b"abc"], [b"abc"]),
    }
    for kind, (s, t) in cases.items():
        al = run(enc(s), enc(t))
        assert al.n_chunks == 1, kind
        assert al.chunk_kind.tolist() == [kind]
        assert al.student_chunk.tolist() == [0] * len(s)
        assert al.teacher_chunk.tolist() == [0] * len(t)
        assert al.chunk_exact.tolist() == [kind == CHUNK_1_1]


def test_mixed_row_chunk_boundaries_are_common_token_boundaries():
    s = [b"ab", b"c", b" ", b"a", b"b", b"cd"]
    t = [b"a", b"bc", b" a", b"bc", b"d"]
    al = run(enc(s), enc(t))
    # common token boundaries at bytes 3, 5 and 8: chunks "abc", " a", "bcd"
    assert al.student_chunk.tolist() == [0, 0, 1, 1, 2, 2]
    assert al.teacher_chunk.tolist() == [0, 0, 1, 2, 2]
    assert al.chunk_kind.tolist() == [CHUNK_N_M, CHUNK_N_1, CHUNK_N_M]
    assert al.chunk_byte_end.tolist() == [3, 5, 8]
    assert al.chunk_student_end.tolist() == [2, 4, 6] and al.chunk_teacher_end.tolist() == [2, 3, 5]


def test_without_byte_tables_lossless_rows_align_by_offsets():
    al = align(enc([b"ab", b"c"]), enc([b"a", b"b", b"c"]))
    assert al.student_chunk.tolist() == [0, 1] and al.teacher_chunk.tolist() == [0, 0, 1]
    assert al.chunk_exact.tolist() == [False, True]


def test_special_tokens_get_minus_one_and_never_join_a_chunk():
    s = enc([BOS, b"ab", b"c", EOS])
    t = enc([BOS, b"abc", EOS])
    al = run(s, t)
    assert al.student_chunk.tolist() == [-1, 0, 0, -1]
    assert al.teacher_chunk.tolist() == [-1, 0, -1]
    assert al.n_chunks == 1 and al.chunk_kind.tolist() == [CHUNK_N_1]


def test_special_covering_text_drops_its_chunk_on_both_sides():
    # the student reads "ab" as one special marker (an added token in the text), the teacher as text
    s = enc([1, b"c"], offsets=[[0, 2], [2, 3]])
    t = enc([b"a", b"b", b"c"])
    al = run(s, t)
    assert al.student_chunk.tolist() == [-1, 0]
    assert al.teacher_chunk.tolist() == [-1, -1, 0]
    assert al.n_chunks == 1 and al.chunk_exact.tolist() == [True]
    assert al.dropped_tokens == 2  # the teacher's "a", "b": counted, not silently lost


def test_empty_text():
    al = run(enc([]), enc([]))
    assert al.n_chunks == 0 and al.student_chunk.size == 0 and al.teacher_chunk.size == 0
    assert not al.used_fallback


def test_overlapping_spans_go_to_the_fallback_and_match_the_truth():
    # "é" split in two byte pieces whose spans were derived from one shared character
    good = enc([b"ab", b"\xc3\xa9", b"c"])
    t = enc([b"a", b"b", b"\xc3\xa9", b"c"])
    pieces_s = [b"ab", b"\xc3", b"\xa9", b"c"]
    vocab_s = VocabBytes.from_pieces([*PIECES, b"\xc3", b"\xa9"])
    ids = np.array([ID[b"ab"], len(PIECES), len(PIECES) + 1, ID[b"c"]], np.int32)
    bo = np.array([[0, 2], [2, 4], [2, 4], [4, 5]], np.int64)
    broken = Encoding(ids=ids, offsets=bo.copy(), byte_offsets=bo, lossless=False)
    al = align(broken, t, student_bytes=vocab_s, teacher_bytes=VOCAB)
    assert al.used_fallback and al.fallback_regions == 1
    assert al.student_chunk.tolist() == [0, 1, 1, 2]
    assert al.teacher_chunk.tolist() == [0, 0, 1, 2]
    assert al.chunk_kind.tolist() == [CHUNK_1_N, CHUNK_N_1, CHUNK_1_1]
    # the cut after the region is trusted again; inside the region it is not
    assert al.chunk_byte_end.tolist() == [2, 4, 5]
    assert b"".join(pieces_s[1:3]) == PIECES[ID[b"\xc3\xa9"]]
    ref = run(good, t)
    assert ref.teacher_chunk.tolist() == al.teacher_chunk.tolist() and not ref.used_fallback


@pytest.mark.parametrize(
    "offsets",
    [
        [[0, 2], [1, 3]],  # overlap
        [[0, 1], [2, 3]],  # gap: spans don't tile the text
        [[0, 2], [0, 0]],  # missing offsets (zeros)
        [[-1, -1], [-1, -1]],  # missing offsets (sentinels)
    ],
)
def test_inconsistent_spans_are_detected_and_realigned(offsets):
    s = enc([b"ab", b"c"], offsets=offsets)
    t = enc([b"a", b"bc"])
    al = run(s, t)
    assert al.used_fallback and al.fallback_regions >= 1
    assert al.student_chunk.tolist() == [0, 0] and al.teacher_chunk.tolist() == [0, 0]


def test_non_lossless_row_is_localised_by_token_lengths():
    # a dummy-prefix tokenizer: the first piece " a" stands for text "a"
    s = enc([b" a", b"b", b"c"], offsets=[[0, 1], [1, 2], [2, 3]], lossless=False)
    t = enc([b"a", b"bc"])
    al = run(s, t)
    assert al.fallback_regions == 1
    assert al.student_chunk.tolist() == [0, 1, 1] and al.teacher_chunk.tolist() == [0, 1]
    assert al.chunk_exact.tolist() == [False, False]  # " a" != "a"


def test_fallback_without_byte_tables_is_an_error_naming_the_row():
    s = enc([b"ab", b"c"], offsets=[[0, 2], [1, 3]])
    with pytest.raises(AlignmentError, match="row 0"):
        align(s, enc([b"abc"]))
    with pytest.raises(AlignmentError, match="row 0"):
        align(enc([b"abc"], lossless=False), enc([b"abc"]))


def test_ids_outside_the_byte_table_are_an_error():
    s = Encoding(
        ids=np.array([99], np.int32),
        offsets=np.array([[0, 1]]),
        byte_offsets=np.array([[0, 1]]),
        lossless=True,
    )
    with pytest.raises(AlignmentError, match="99"):
        run(s, enc([b"a"]))


def test_different_text_lengths_end_in_one_fallback_tail():
    al = run(enc([b"ab", b"c"]), enc([b"ab", b"cd"]))
    assert al.used_fallback
    assert al.student_chunk.tolist() == [0, 1] and al.teacher_chunk.tolist() == [0, 1]
    assert al.chunk_byte_end.tolist() == [2, -1]  # the two ends are not one text position


def _batch(encs: list[Encoding]) -> BatchEncoding:
    splits = np.cumsum([0] + [len(e.ids) for e in encs]).astype(np.int64)
    cat = lambda f: np.concatenate([getattr(e, f) for e in encs])  # noqa: E731
    return BatchEncoding(
        ids=cat("ids"),
        offsets=cat("offsets").reshape(-1, 2),
        byte_offsets=cat("byte_offsets").reshape(-1, 2),
        row_splits=splits,
        lossless=np.array([e.lossless for e in encs]),
    )


def test_batch_equals_rows_and_errors_stay_per_row():
    rows_s = [enc([b"ab", b"c"]), enc([]), enc([b"a", b"b"], offsets=[[0, 1], [0, 2]]), enc([b"d"])]
    rows_t = [enc([b"a", b"bc"]), enc([]), enc([b"ab"]), enc([b"d"])]
    flat = align_batch_flat(_batch(rows_s), _batch(rows_t))  # no tables: row 2 cannot fall back
    assert flat.row_error.tolist() == [0, 0, 1, 0]
    assert flat.row(3).student_chunk.tolist() == [0]
    with pytest.raises(AlignmentError, match="row 2"):
        flat.row(2)
    with_tabs = align_batch(
        _batch(rows_s), _batch(rows_t), student_bytes=VOCAB, teacher_bytes=VOCAB
    )
    for s, t, got in zip(rows_s, rows_t, with_tabs):
        one = run(s, t)
        assert got.student_chunk.tolist() == one.student_chunk.tolist()
        assert got.teacher_chunk.tolist() == one.teacher_chunk.tolist()
        assert got.chunk_kind.tolist() == one.chunk_kind.tolist()
        assert got.used_fallback == one.used_fallback


def test_forced_fallback_reproduces_the_fast_path():
    s = enc([BOS, b"ab", b"c", b" ", b"a", b"b", b"cd", EOS])
    t = enc([BOS, b"a", b"bc", b" a", b"bc", b"d"])
    fast = run(s, t)
    dp = run(s, t, force_fallback=True)
    assert dp.used_fallback and not fast.used_fallback
    assert dp.student_chunk.tolist() == fast.student_chunk.tolist()
    assert dp.teacher_chunk.tolist() == fast.teacher_chunk.tolist()
    assert dp.chunk_kind.tolist() == fast.chunk_kind.tolist()
