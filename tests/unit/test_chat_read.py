"""Conversation rows out of files (`pipelines.align.chat_read`): jsonl and parquet, the format per file,
row numbers across byte ranges, and what is bad before parsing as dead letters."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.align import readers
from pipelines.align.chat_read import ROW_FORMAT_MISMATCH, Row, peek_format, read_rows
from tokenbridge.chat import rows

MSG = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
PC = {"prompt": "Hi", "completion": [{"role": "assistant", "content": "Yo"}]}


def _lines(path, lines: list[bytes]) -> list[int]:
    """Write `lines` (each + newline); returns the byte offset of each."""
    at, offsets = 0, []
    for x in lines:
        offsets.append(at)
        at += len(x) + 1
    path.write_bytes(b"".join(x + b"\n" for x in lines))
    return offsets


def _split(items):
    good = [x for x in items if isinstance(x, Row)]
    return good, [x for x in items if not isinstance(x, Row)]


def test_jsonl_rows_numbers_and_bad_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    _lines(path, [json.dumps(MSG).encode(), b"", b"{oops", b'{"messages": "x"}',
                  b'{"text": "plain"}', b"\xff\xfe", json.dumps(MSG).encode()])  # fmt: skip
    good, dead = _split(list(read_rows(str(path), "a.jsonl", row_format=None)))
    assert [(r.row, r.doc_id, r.fmt) for r in good] == [
        (0, "a.jsonl:0", rows.MESSAGES),
        (3, "a.jsonl:3", rows.MESSAGES),  # parse_row will refuse it, with its field
        (4, "a.jsonl:4", rows.MESSAGES),  # a record without 'messages' in a messages file: same
        (6, "a.jsonl:6", rows.MESSAGES),
    ]
    assert good[0].value == MSG
    assert [(d["row"], d["line"], d["reason"]) for d in dead] == [
        (2, 3, readers.BAD_JSON),
        (5, 6, readers.UNDECODABLE),
    ]
    assert all(d["file"] == str(path) for d in dead)
    parsed = rows.parse_row(good[2].value, fmt=good[2].fmt)
    assert isinstance(parsed, rows.DeadLetter) and parsed.reason == rows.MISSING_FIELD


def test_a_later_byte_range_takes_the_files_format(tmp_path):
    """A range whose first record is bad (no conversation keys) is not taken for a text file."""
    path = tmp_path / "big.jsonl"
    offsets = _lines(path, [json.dumps(PC).encode(), b'{"other": 1}', json.dumps(PC).encode()])
    split = readers.Split(offsets[1], None, first_row=1)
    good, dead = _split(list(read_rows(str(path), "big.jsonl", row_format=None, split=split)))
    assert dead == [] and [(r.row, r.fmt) for r in good] == [(1, rows.PROMPT_COMPLETION),
                                                             (2, rows.PROMPT_COMPLETION)]  # fmt: skip


def test_text_files_in_a_conversation_job_are_one_dead_letter(tmp_path):
    text = tmp_path / "t.jsonl"
    text.write_text('{"text": "a"}\n{"text": "b"}\n')
    txt = tmp_path / "t.txt"
    txt.write_text("plain text")
    for p in (text, txt):
        items = list(read_rows(str(p), p.name, row_format=None))
        assert len(items) == 1 and items[0]["reason"] == ROW_FORMAT_MISMATCH, items
        assert "its own" in items[0]["detail"]
    assert peek_format(str(text)) == rows.TEXT and peek_format(str(txt)) is None
    # a file named as messages by the job reads its records as such (parse_row judges them)
    named = list(read_rows(str(text), "t.jsonl", row_format=rows.MESSAGES))
    assert [type(x) for x in named] == [Row, Row]


def test_parquet_messages_and_prompt_completion(tmp_path):
    m = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist([MSG, MSG]), m)
    good, dead = _split(list(read_rows(str(m), "m.parquet", row_format=None)))
    assert dead == [] and [r.doc_id for r in good] == ["m.parquet:0", "m.parquet:1"]
    assert good[1].value == MSG and good[1].fmt == rows.MESSAGES
    assert peek_format(str(m)) == rows.MESSAGES
    pc = tmp_path / "pc.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "Hi", "completion": "Yo", "id": 3}]), pc)
    good, _ = _split(list(read_rows(str(pc), "pc.parquet", row_format=None)))
    assert good[0].value == {"prompt": "Hi", "completion": "Yo"}  # only the columns it needs
    conv = rows.parse_row(good[0].value, fmt=good[0].fmt)
    assert conv.roles == ("user", "assistant")
    # the job names messages, the file has prompt/completion columns: which column is missing
    items = list(read_rows(str(pc), "pc.parquet", row_format=rows.MESSAGES))
    assert len(items) == 1 and items[0]["reason"] == readers.MISSING_FIELD
    assert "'messages'" in items[0]["detail"]
