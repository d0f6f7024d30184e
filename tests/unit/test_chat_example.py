"""The shipped example conversations: rebuilt byte for byte, every row parses and aligns."""

from __future__ import annotations

import json

import pytest

from tokenbridge.chat import rows, templates
from tokenbridge.chat.align import ChatAlignment, align_conversations, prepare_side
from tokenbridge.commands import chat_example
from tokenbridge.tokenizers import load_tokenizer


def test_rebuilds_byte_for_byte(tmp_path, corpus_dir):
    written = chat_example.write(tmp_path, corpus_dir / "shakespeare")
    for f in written:
        shipped = chat_example.DATA_DIR / f.name
        assert f.read_bytes() == shipped.read_bytes(), f"{shipped} is stale: rerun the generator"
    assert sum(f.stat().st_size for f in written) < 200_000


@pytest.fixture(scope="module")
def example_rows():
    out = {}
    for name in (chat_example.MESSAGES_FILE, chat_example.PROMPT_COMPLETION_FILE):
        data = [json.loads(x) for x in (chat_example.DATA_DIR / name).read_text().splitlines()]
        fmt = rows.detect_format(data[0], where=name)
        out[name] = [rows.parse_row(r, fmt=fmt) for r in data]
    return out


def test_every_row_parses(example_rows):
    convs = example_rows[chat_example.MESSAGES_FILE]
    assert all(isinstance(c, rows.Conversation) for c in convs)
    roles = {c.roles for c in convs}
    assert ("user", "assistant") in roles and (
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ) in roles
    assert any(c.messages[0].content == "" for c in convs)  # empty system turns
    pcs = example_rows[chat_example.PROMPT_COMPLETION_FILE]
    assert all(isinstance(c, rows.Conversation) for c in pcs)


def test_every_row_aligns_with_the_shipped_pair(example_rows, student_dir, teacher_dir):
    student = prepare_side(load_tokenizer(student_dir), templates.resolve_template(student_dir))
    teacher = prepare_side(load_tokenizer(teacher_dir), templates.shipped_template("gemma"))
    convs = [c for cs in example_rows.values() for c in cs]
    out = align_conversations(convs, student=student, teachers=[teacher]).results()
    assert all(isinstance(r, ChatAlignment) for r in out), [
        r for r in out if not isinstance(r, ChatAlignment)
    ][:3]
    assert (
        sum(r.pairs[0].loose for r in out) == 0
    )  # ChatML and gemma cut no token at a content edge
