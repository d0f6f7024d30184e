"""Conversation rows: format detection, parsing, and a dead letter for every bad kind of row."""

from __future__ import annotations

import pytest

from tokenbridge.chat import rows
from tokenbridge.chat.rows import Conversation, DeadLetter, parse_row


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


@pytest.mark.parametrize(
    "row, fmt",
    [
        ({"messages": []}, rows.MESSAGES),
        ({"prompt": "q", "completion": "a", "text": "x"}, rows.PROMPT_COMPLETION),
        ({"text": "plain", "id": 3}, rows.TEXT),
        ({"messages": [], "text": "both"}, rows.MESSAGES),
    ],
)
def test_detect_format(row, fmt):
    assert rows.detect_format(row) == fmt


def test_detect_format_names_what_it_found():
    with pytest.raises(ValueError, match=r"data\.jsonl.*\['body', 'id'\].*row-format"):
        rows.detect_format({"id": 1, "body": "x"}, where="data.jsonl")
    with pytest.raises(ValueError, match="list"):
        rows.detect_format([1, 2])


def test_messages_row():
    conv = parse_row(
        {"messages": _msgs(("system", ""), ("user", "Hi"), ("assistant", "Hello")), "id": 7},
        fmt=rows.MESSAGES,
    )
    assert isinstance(conv, Conversation)
    assert conv.roles == ("system", "user", "assistant")
    assert [m.trainable for m in conv.messages] == [False, False, True]
    assert conv.messages[0].content == ""  # an empty system turn is allowed


def test_prompt_completion_strings_and_lists():
    conv = parse_row({"prompt": "Who?", "completion": "Me."}, fmt=rows.PROMPT_COMPLETION)
    assert conv.roles == ("user", "assistant")
    assert [m.trainable for m in conv.messages] == [False, True]
    conv = parse_row(
        {
            "prompt": _msgs(("system", "S"), ("user", "U"), ("assistant", "A1"), ("user", "U2")),
            "completion": _msgs(("assistant", "A2")),
        },
        fmt=rows.PROMPT_COMPLETION,
    )
    assert conv.roles == ("system", "user", "assistant", "user", "assistant")
    # only the completion is trained: the prompt's assistant turn is context
    assert [m.trainable for m in conv.messages] == [False, False, False, False, True]


def test_tool_result_turn_is_content_and_name_is_passed():
    conv = parse_row(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "tool", "content": '{"temp": 12}', "tool_call_id": "c1", "name": "w"},
                {"role": "assistant", "content": "12 degrees.", "tool_calls": []},
            ]
        },
        fmt=rows.MESSAGES,
    )
    assert conv.roles == ("user", "tool", "assistant")
    assert conv.messages[1].as_dict() == {
        "role": "tool",
        "content": '{"temp": 12}',
        "name": "w",
        "tool_call_id": "c1",
    }


BAD_ROWS = [
    (rows.MESSAGES, {"text": "x"}, rows.MISSING_FIELD, "messages"),
    (rows.MESSAGES, {"messages": "hi"}, rows.BAD_FIELD_TYPE, "messages"),
    (rows.MESSAGES, {"messages": []}, rows.BAD_MESSAGE, "messages"),
    (rows.MESSAGES, {"messages": ["hi"]}, rows.BAD_MESSAGE, "messages[0]"),
    (rows.MESSAGES, {"messages": [{"role": "user"}]}, rows.MISSING_FIELD, "messages[0]"),
    (
        rows.MESSAGES,
        {"messages": _msgs(("user", "a"), ("robot", "b"))},
        rows.UNKNOWN_ROLE,
        "messages[1].role",
    ),
    (
        rows.MESSAGES,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        rows.NON_STRING_CONTENT,
        "messages[0].content",
    ),
    (
        rows.MESSAGES,
        {"messages": _msgs(("user", "a"), ("assistant", " \n"))},
        rows.EMPTY_ASSISTANT,
        "messages[1].content",
    ),
    (
        rows.MESSAGES,
        {"messages": _msgs(("system", "s"), ("user", "a"))},
        rows.NOTHING_TO_TRAIN,
        "messages",
    ),
    (
        rows.MESSAGES,
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
            ]
        },
        rows.TOOL_CALLS,
        "messages[1].tool_calls",
    ),
    (
        rows.MESSAGES,
        {"messages": _msgs(("user", "a"), ("assistant", "b")), "tools": [{"name": "f"}]},
        rows.TOOL_CALLS,
        "tools",
    ),
    (
        rows.MESSAGES,
        {"messages": [{"role": "assistant", "content": "b", "reasoning_content": "hm"}]},
        rows.UNSUPPORTED_FIELD,
        "messages[0].reasoning_content",
    ),
    (
        rows.MESSAGES,
        {"messages": [{"role": "assistant", "content": "b", "name": 3}]},
        rows.BAD_FIELD_TYPE,
        "messages[0].name",
    ),
    (rows.PROMPT_COMPLETION, {"prompt": "q"}, rows.MISSING_FIELD, "completion"),
    (
        rows.PROMPT_COMPLETION,
        {"prompt": 5, "completion": "a"},
        rows.BAD_FIELD_TYPE,
        "prompt",
    ),
    (
        rows.PROMPT_COMPLETION,
        {"prompt": "q", "completion": _msgs(("user", "not a reply"))},
        rows.NOTHING_TO_TRAIN,
        "completion",
    ),
    (rows.PROMPT_COMPLETION, {"prompt": "q", "completion": ""}, rows.EMPTY_ASSISTANT, None),
    (rows.MESSAGES, ["not", "an", "object"], rows.BAD_FIELD_TYPE, ""),
    (
        rows.MESSAGES,
        {"messages": _msgs(("user", "a\ud800"), ("assistant", "b"))},
        rows.UNDECODABLE,
        "messages[0].content",
    ),
]


@pytest.mark.parametrize("fmt, row, reason, field", BAD_ROWS)
def test_bad_rows_are_dead_letters(fmt, row, reason, field):
    dead = parse_row(row, fmt=fmt)
    assert isinstance(dead, DeadLetter), dead
    assert dead.reason == reason, dead
    if field is not None:
        assert dead.field == field
    assert dead.detail


def test_train_all_accepts_a_conversation_without_assistant():
    row = {"messages": _msgs(("user", "a"))}
    assert parse_row(row, fmt=rows.MESSAGES).reason == rows.NOTHING_TO_TRAIN
    assert isinstance(parse_row(row, fmt=rows.MESSAGES, train_on=rows.TRAIN_ALL), Conversation)


def test_dead_letter_record_has_the_readers_shape():
    dead = DeadLetter(rows.TEMPLATE_DROPPED, "messages[0].content", "gone", side="phi-3")
    rec = dead.record(file="a.jsonl", row=4, doc_id="a.jsonl:4")
    assert rec == {
        "file": "a.jsonl",
        "row": 4,
        "line": 5,
        "field": "messages[0].content",
        "doc_id": "a.jsonl:4",
        "reason": rows.TEMPLATE_DROPPED,
        "detail": "phi-3: gone",
    }


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="text"):
        parse_row({"text": "x"}, fmt=rows.TEXT)
    with pytest.raises(ValueError, match="train_on"):
        parse_row({"messages": []}, fmt=rows.MESSAGES, train_on="everything")
