"""On-the-fly alignment of rollouts (real SmolLM2 and Gemma tokenizers): equal to what the align
path writes for the same text, completion chunks only, invalid UTF-8 over bytes, drops counted,
the stop paired by role, chat completions after each side's own template."""

from __future__ import annotations

import numpy as np
import pytest

from tokenbridge.alignment import WindowConfig, align, cut_windows
from tokenbridge.chat.align import prepare_side
from tokenbridge.chat.templates import named_template
from tokenbridge.tokenizers import load_tokenizer
from trainer.onpolicy.realign import (
    DROP_NO_CHUNK,
    DROP_TOO_LONG,
    TeacherView,
    align_rollout,
    lenient_text,
)
from trainer.onpolicy.rollouts import build_batch
from trainer.onpolicy.sampling.sampler import Rollouts

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  Tabs\tand spaces,  1234567 apples; naïve café — ünïcödé 日本語 text!\n\nNew paragraph.",
    "And God said, Let there be light: and there was light. 2024-11-25, 3.14159",
]


@pytest.fixture(scope="module")
def toks(student_dir, teacher_dir):
    return load_tokenizer(student_dir), load_tokenizer(teacher_dir)


def _window(text, s_tok, t_tok):
    """What the align path writes for `text` as one document: its single window."""
    s_enc, t_enc = s_tok.encode(text), t_tok.encode(text)
    al = align(s_enc, t_enc, student_bytes=s_tok, teacher_bytes=t_tok)
    (w,) = cut_windows(text, student=(s_tok, s_enc), teachers=[(t_tok, t_enc, al)],
                       config=WindowConfig(4096, 4096))  # fmt: skip
    return w


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_len", [1, 5, 9])
def test_rollout_alignment_equals_the_align_path(toks, text, prompt_len):
    s_tok, t_tok = toks
    w = _window(text, s_tok, t_tok)
    ids = w.student_ids.tolist()  # BOS + text tokens + EOS: the sampled ids are the truth
    view = TeacherView(t_tok, 4096, stop_id=t_tok.eos_id)
    ra = align_rollout(ids[:prompt_len], ids[prompt_len:], stopped=True, student=s_tok, view=view)
    assert ra.dropped is None
    assert np.array_equal(ra.teacher_ids, w.teacher_ids[0])  # same text -> same teacher tokens
    sc, tc = w.teacher_student_chunk[0].astype(np.int64), w.teacher_chunk[0].astype(np.int64)
    # the align path's chunks of the completion, renumbered from 0; the prompt's are -1
    first = sc[prompt_len:][sc[prompt_len:] >= 0].min()
    if prompt_len > 1 and sc[prompt_len - 1] == first:  # a chunk across the edge is dropped
        first += 1
        assert ra.boundary_chunks == 1
    want_s = np.where(sc >= first, sc - first, -1)
    want_t = np.where(tc >= first, tc - first, -1)
    # the student's EOS and the teacher's EOS are paired as one last chunk, by role
    n = int(want_s.max()) + 1
    want_s[-1], want_t[-1] = n, n
    assert np.array_equal(ra.student_chunk, want_s)
    assert np.array_equal(ra.teacher_chunk, want_t)
    assert ra.n_chunks == n + 1


def test_lenient_text_maps_bytes_around_invalid_pieces():
    lt = lenient_text(b"ab\xe2\x82cd\xff")
    assert lt.text == "ab\ufffdcd\ufffd" and not lt.valid
    assert lt.pos_map.tolist() == [0, 1, 2, 2, 5, 6, 7, 10]
    assert lt.bad.tolist() == [False, False, True, True, False, False, True]
    assert lenient_text("é ok".encode()).valid


def _byte_tokens(s_tok, data: bytes) -> list[int]:
    """SmolLM2's single-byte tokens spelling `data` (byte-level BPE has all 256)."""
    table = {b: i for i, b in enumerate(s_tok.token_bytes()) if b is not None and len(b) == 1}
    return [table[bytes([x])] for x in data]


def test_invalid_utf8_chunks_are_dropped_and_counted(toks):
    s_tok, t_tok = toks
    view = TeacherView(t_tok, 4096)
    prompt = [s_tok.bos_id, *s_tok.encode("The price is").ids.tolist()]
    # " 5 euros" then a cut "€" (e2 82 of e2 82 ac): the completion ends inside a character
    completion = s_tok.encode(" 5 euros ").ids.tolist() + _byte_tokens(s_tok, b"\xe2\x82")
    ra = align_rollout(prompt, completion, stopped=False, student=s_tok, view=view)
    assert ra.dropped is None and ra.invalid_chunks == 1
    kept = ra.student_chunk[len(prompt) :]
    # the cut character's bytes (and a token that shares their chunk: the space before them,
    # which Gemma spells with the replacement) get no term; the valid text before keeps its own
    assert (kept[-2:] == -1).all() and (kept[:3] >= 0).all()
    # bytes that are no UTF-8 at all, alone: nothing left to compare, the rollout is dropped
    bad = align_rollout(prompt, _byte_tokens(s_tok, b"\x80\xbf\x80"), stopped=False,
                        student=s_tok, view=view)  # fmt: skip
    assert bad.dropped == DROP_NO_CHUNK


def test_a_rollout_longer_than_the_teacher_slot_is_dropped(toks):
    s_tok, t_tok = toks
    ids = s_tok.encode(TEXTS[1]).ids.tolist()
    ra = align_rollout(ids[:2], ids[2:], stopped=False, student=s_tok, view=TeacherView(t_tok, 8))
    assert ra.dropped == DROP_TOO_LONG


def test_batch_counts_drops_and_keeps_shapes(toks):
    s_tok, t_tok = toks
    good = s_tok.encode(TEXTS[0]).ids.tolist()
    r = Rollouts(
        prompts=[[s_tok.bos_id, *good[:3]], [s_tok.bos_id, *good[:2]]],
        completions=[good[3:], _byte_tokens(s_tok, b"\x80\x80")],
        stopped=[False, False],
        prompt_index=[0, 1],
    )
    views = [TeacherView(t_tok, 4096), None]
    b = build_batch(r, [0, 1], student=s_tok, teachers=views, want_cols=[False, False], pad_id=0)
    assert b.drops[0] == {DROP_NO_CHUNK: 1} and not b.drops[1]
    gemma, same = b.aligned
    assert int(gemma.n_chunks[1]) == 0 and (gemma.student_chunk[1] == -1).all()
    # the same tokenizer: one chunk per sampled token, the teacher reads the sampled ids
    assert same.teacher_ids.equal(b.input_ids_BT)
    assert same.n_chunks.tolist() == [len(good) - 3, 2]
    assert (b.targets_BT[0, :3] == -1).all() and b.targets_BT[0, 3] == good[3]


def test_chat_completion_aligns_after_each_template(toks):
    s_tok, t_tok = toks
    from trainer.onpolicy.prompts import render_prompt

    s_side = prepare_side(s_tok, named_template("chatml"))
    t_side = prepare_side(t_tok, named_template("gemma"))
    messages = ({"role": "user", "content": "Who speaks first in Hamlet?"},)
    rendering = render_prompt(s_side, list(messages))
    assert rendering.text.endswith("<|im_start|>assistant\n")
    from tokenbridge.chat.encode import encode_renderings

    prompt = encode_renderings(s_tok, s_side.matcher, [rendering]).ids.tolist()
    end_of_turn = int(s_side.markers.close_ids[0])
    completion = s_tok.encode("Bernardo speaks first, 1 night.").ids.tolist() + [end_of_turn]
    view = TeacherView(t_tok, 4096, t_side, int(t_side.markers.close_ids[0]))
    ra = align_rollout(prompt, completion, stopped=True, student=s_tok, view=view,
                       messages=messages)  # fmt: skip
    assert ra.dropped is None and ra.boundary_chunks == 0
    assert (ra.student_chunk[: len(prompt)] == -1).all()
    assert (ra.student_chunk[len(prompt) :] >= 0).all()
    # the teacher reads its own rendering of the conversation, then the same completion bytes
    t_text = t_tok.decode(ra.teacher_ids[ra.teacher_chunk >= 0][:-1])
    assert t_text == "Bernardo speaks first, 1 night."
    assert t_tok.special_content(int(ra.teacher_ids[-1])) == "<end_of_turn>"
    assert ra.student_chunk[-1] == ra.teacher_chunk[-1] == ra.n_chunks - 1


def test_chat_prompt_rollouts_batch_for_a_teacher_template(toks, student_dir):
    """`ChatPrompts` (the shipped conversations, SmolLM2's own template) -> rollouts -> the
    batch for Gemma: each teacher renders the prompt's messages in its template; only the
    completion gets chunks; a rollout that stopped on the student's end-of-turn pairs it with
    Gemma's."""
    from tokenbridge import paths
    from trainer.config.sections import DataConfig
    from trainer.onpolicy.prompts import ChatPrompts

    s_tok, t_tok = toks
    data = paths.REPO_ROOT / "tokenbridge" / "chat" / "data" / "shakespeare_messages.jsonl"
    split = DataConfig(shards="unused", eval_fraction=0.0, max_student_tokens=512)
    src = ChatPrompts(data, s_tok, data=split, model_dir=student_dir, template=None, dp_rank=0,
                      dp_size=1, seed=1)  # fmt: skip
    p = src.next_prompts(1)[0]
    eot = int(src.side.markers.close_ids[0])
    said = s_tok.encode("Marry, my lord.").ids.tolist()
    r = Rollouts(prompts=[list(p.ids)] * 2, completions=[[*said, eot], said[:3]],
                 stopped=[True, False], prompt_index=[0, 0])  # fmt: skip
    r.meta = [{"key": p.key, "messages": p.messages}] * 2
    t_side = prepare_side(t_tok, named_template("gemma"))
    view = TeacherView(t_tok, 4096, t_side, int(t_side.markers.close_ids[0]))
    b = build_batch(r, [0, 1], student=s_tok, teachers=[view], want_cols=[False], pad_id=0)
    gemma = b.aligned[0]
    assert not b.drops[0] and gemma.n_chunks.tolist()[0] > gemma.n_chunks.tolist()[1] > 0
    n = len(p.ids)
    assert (gemma.student_chunk[:, :n] == -1).all()
    last = int(gemma.n_chunks[0]) - 1  # the stop pair: the last chunk on both sides
    assert int(gemma.student_chunk[0, n + len(said)]) == last
    t_row = gemma.teacher_ids[0][gemma.teacher_chunk[0] == last].tolist()
    assert [t_tok.special_content(i) for i in t_row] == ["<end_of_turn>"]
    t_text = t_tok.decode(gemma.teacher_ids[0][: int((gemma.teacher_ids[0] != 0).sum())].tolist())
    assert p.messages[-1]["content"] in t_text and "<start_of_turn>model" in t_text
