"""The offsets kernel (`token_bytes.batch_offsets`) against the numpy path it replaced: every
array of `encode_batch` equal, on every tokenizer, on hypothesis text (the property tests'
alphabet: literal "▁", bytes a vocabulary lacks, dummy prefixes, specials written as text), on
batches mixing fast and slow rows, and on the shipped corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_tokenizer_properties import TEXTS
from tokenbridge import paths
from tokenbridge.tokenizers import load_tokenizer
from tokenbridge.tokenizers.adapter import BatchEncoding
from tokenbridge.tokenizers.token_bytes import TextBytes


@pytest.fixture(scope="module")
def tokenizers(teacher_dir, student_dir, vocab_fixture):
    toks = [load_tokenizer(teacher_dir), load_tokenizer(student_dir)]
    return toks + [load_tokenizer(vocab_fixture(f)) for f in paths.VOCAB_FAMILIES]


def _expected_stream(tb, prefix, keep):
    kept = np.ones(len(tb.buf), dtype=bool) if keep is None else keep[tb.buf]
    kept_at = np.flatnonzero(kept)
    kept_before = np.concatenate([[0], np.cumsum(kept)])
    n_kept = np.diff(kept_before[tb.byte_base])
    base = np.concatenate([[0], np.cumsum(n_kept + prefix)]).astype(np.int64)
    row_of_kept = np.searchsorted(tb.byte_base, kept_at, side="right") - 1
    pos = (
        base[row_of_kept]
        + prefix[row_of_kept]
        + kept_before[kept_at]
        - kept_before[tb.byte_base[row_of_kept]]
    )
    buf = np.full(int(base[-1]), 0x20, dtype=np.uint8)
    src_start = np.empty(int(base[-1]), dtype=np.int64)
    buf[pos] = tb.buf[kept_at]
    src_start[pos] = kept_at
    src_end = np.empty_like(src_start)
    src_end[pos] = kept_at + 1
    invented = base[:-1][prefix > 0]
    src_start[invented] = src_end[invented] = tb.byte_base[:-1][prefix > 0]
    return buf, base, src_start, src_end, np.diff(tb.byte_base) - n_kept


def _mismatched_rows(table, ids, out_pos, expected, row_of_token):
    lengths = table.length[ids]
    n_bytes = int(lengths.sum())
    if n_bytes == 0:
        return np.zeros(0, dtype=np.int64)
    within = np.arange(n_bytes, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    src = np.repeat(table.start[ids], lengths) + within
    dst = np.repeat(out_pos, lengths) + within
    bad = table.flat[src] != expected[dst]
    return np.unique(np.repeat(row_of_token, lengths)[bad])


def reference_encode_batch(tok, texts: list[str]) -> BatchEncoding:
    """`Tokenizer.encode_batch` as it was before the kernel: numpy passes over the batch."""
    n_rows = len(texts)
    rows = tok._backend.encode_ids(texts)
    counts = np.array([len(r) for r in rows], dtype=np.int64)
    row_splits = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    n_tok = int(row_splits[-1])
    ids = np.array([i for r in rows for i in r], dtype=np.int32)
    tb = TextBytes.build(texts)
    row_of_token = np.repeat(np.arange(n_rows), counts)
    lengths = tok._table.length[ids]
    special = lengths < 0
    lengths = np.where(special, 0, lengths)
    prefix = tok._prefix_per_row(texts, np.diff(tb.byte_base))
    keep = None if tok._keep_bytes.all() else tok._keep_bytes
    buf, base, src_start, src_end, dropped = _expected_stream(tb, prefix, keep)
    n_special = np.bincount(row_of_token, weights=special, minlength=n_rows)
    total = np.bincount(row_of_token, weights=lengths, minlength=n_rows)
    fast = (n_special == 0) & (total == np.diff(base))
    cum = np.cumsum(lengths)
    start = cum - np.concatenate([[0], cum])[row_splits[:-1]][row_of_token] - lengths
    check = fast[row_of_token]
    at = base[row_of_token] + start
    fast[_mismatched_rows(tok._table, ids[check], at[check], buf, row_of_token[check])] = False
    offsets = np.zeros((n_tok, 2), dtype=np.int64)
    byte_offsets = np.zeros((n_tok, 2), dtype=np.int64)
    sel = fast[row_of_token] & (lengths > 0)
    r = row_of_token[sel]
    gs = src_start[at[sel]]
    ge = src_end[at[sel] + lengths[sel] - 1]
    byte_offsets[sel] = np.stack([gs, ge], axis=1) - tb.byte_base[r, None]
    cs, ce = tb.bytes_to_chars(gs, ge)
    offsets[sel] = np.stack([cs, ce], axis=1) - tb.char_base[r, None]
    lossless = fast & (prefix == 0) & (dropped == 0)
    slow = np.flatnonzero(~fast)
    if len(slow):
        tok._slow_rows(texts, slow, ids, row_splits, tb, offsets, byte_offsets, lossless)
    return BatchEncoding(ids, offsets, byte_offsets, row_splits, lossless)


def assert_same(tok, texts: list[str]) -> None:
    got, want = tok.encode_batch(texts), reference_encode_batch(tok, texts)
    for field in ("ids", "offsets", "byte_offsets", "row_splits", "lossless"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape, (tok.name, field, texts)
        assert np.array_equal(a, b), (tok.name, field, texts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(TEXTS, max_size=12))
def test_kernel_equals_numpy_path(tokenizers, texts):
    for tok in tokenizers:
        assert_same(tok, texts)


def test_kernel_equals_numpy_path_on_edges(tokenizers):
    texts = ["", " ", "\u2581", "\u2581x", "a\x00b", "\U0001f917 e\u0301", "<eos> hi", "\ufeff", ""]
    for tok in tokenizers:
        assert_same(tok, texts)
        assert_same(tok, [])
        for t in texts:
            assert_same(tok, [t])


def test_kernel_equals_numpy_path_on_corpus(tokenizers, corpus_dir):
    lines = (corpus_dir / "kjv_letters.jsonl").read_text().splitlines()[:300]
    texts = [json.loads(x)["text"] for x in lines]
    plays = sorted((corpus_dir / "shakespeare").glob("*.txt"))[:1]
    texts += [p.read_text()[:20000] for p in plays]
    for tok in tokenizers:
        assert_same(tok, texts)
