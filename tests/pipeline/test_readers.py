"""Readers: documents out of txt/jsonl/parquet, and a dead letter for every kind of bad input."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.align import readers


def _split(items):
    docs = [x for x in items if isinstance(x, readers.Doc)]
    dead = [x for x in items if not isinstance(x, readers.Doc)]
    return docs, dead


def _read(path, **kw):
    return _split(list(readers.read_file(str(path), path.name, readers.ReaderConfig(**kw))))


def test_txt_file_mode_strips_bom_only(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"\xef\xbb\xbfHello\n\nworld \xc3\xbc\n")
    docs, dead = _read(p)
    assert dead == [] and docs == [readers.Doc("a.txt", "Hello\n\nworld ü\n")]


def test_txt_blocks_mode_ids_lines_and_bad_block(tmp_path):
    p = tmp_path / "b.txt"
    p.write_bytes(b"\n\nfirst block\nstill first\n\n \t\n\nsecond \xff block\r\n\r\nthird\n")
    docs, dead = _read(p, txt_mode="blocks")
    assert docs == [
        readers.Doc("b.txt:0", "first block\nstill first"),
        readers.Doc("b.txt:2", "third\n"),
    ]
    assert len(dead) == 1
    d = dead[0]
    assert (d["reason"], d["row"], d["line"], d["doc_id"]) == (readers.UNDECODABLE, 1, 8, "b.txt:1")
    assert "byte 7" in d["detail"] and "\\xff" in d["detail"]


def test_txt_undecodable_and_empty_files(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok text \xc3\x28 more")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b" \n\n\t\n")
    assert _read(bad)[1][0]["reason"] == readers.UNDECODABLE
    assert _read(bad)[1][0]["file"] == str(bad)
    for mode in readers.TXT_MODES:
        docs, dead = _read(empty, txt_mode=mode)
        assert docs == [] and [d["reason"] for d in dead] == [readers.EMPTY_DOCUMENT]


def test_jsonl_every_bad_record_kind(tmp_path):
    p = tmp_path / "c.jsonl"
    lines = [
        json.dumps({"text": "one"}).encode(),
        b"",  # blank line: not a record
        json.dumps({"body": "no text"}).encode(),
        b"{not json",
        json.dumps({"text": 5}).encode(),
        json.dumps({"text": "   "}).encode(),
        b'{"text": "caf\xe9"}',  # latin-1 byte
        json.dumps({"text": "two"}).encode(),
    ]
    p.write_bytes(b"\n".join(lines) + b"\n")
    docs, dead = _read(p)
    assert docs == [readers.Doc("c.jsonl:0", "one"), readers.Doc("c.jsonl:7", "two")]
    got = [(d["reason"], d["row"], d["line"], d["field"]) for d in dead]
    assert got == [
        (readers.MISSING_FIELD, 2, 3, "text"),
        (readers.BAD_JSON, 3, 4, None),
        (readers.BAD_FIELD_TYPE, 4, 5, "text"),
        (readers.EMPTY_DOCUMENT, 5, 6, "text"),
        (readers.UNDECODABLE, 6, 7, None),
    ]
    assert "found ['body']" in dead[0]["detail"]


def test_jsonl_fast_path_matches_the_checked_path(tmp_path):
    """`read_jsonl` parses a regular line once and checks nothing else; every line, regular or
    not, must read as `_text_or_dead` (the path that checks each step) reads it alone."""
    lines = [
        json.dumps({"text": "plain", "n": 1}).encode(),
        json.dumps({"text": "naïve café 日本"}, ensure_ascii=False).encode(),
        b"",
        b"  \t",
        json.dumps(["text", "a list"]).encode(),
        json.dumps("text").encode(),
        json.dumps({"text": {"nested": "x"}}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps({"text": "\u2003\n"}).encode(),  # only (Unicode) whitespace
        json.dumps({"text": ""}).encode(),
        b'{"text": "dup", "text": "last wins"}',
        b'{"text": NaN}',
        b"\xef\xbb\xbf" + json.dumps({"text": "after a BOM"}).encode(),
        b'{"text": "ok"} trailing',
        json.dumps({"text": " spaced "}).encode(),
    ]
    p = tmp_path / "m.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    for field in ("text", "meta.text"):
        got = list(readers.read_jsonl(str(p), "m.jsonl", field=field))
        want = []
        for row, raw in enumerate(p.read_bytes().splitlines(keepends=True)):
            out = readers._text_or_dead(str(p), "m.jsonl", row, raw, field=field)
            want += [] if out is None else [out]
        assert got == want
        assert [type(x) for x in got] == [type(x) for x in want]
    docs = [d.text for d in readers.read_jsonl(str(p), "m.jsonl") if isinstance(d, readers.Doc)]
    assert docs == ["plain", "naïve café 日本", "last wins", " spaced "]


def test_jsonl_nested_field_and_gzip(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(json.dumps({"meta": {"body": "nested"}}).encode() + b"\n")
    docs, dead = _read(p, text_field="meta.body")
    assert dead == [] and docs == [readers.Doc("d.jsonl.gz:0", "nested")]


def test_corrupt_gzip_and_unknown_format_are_dead_letters(tmp_path):
    p = tmp_path / "e.jsonl.gz"
    p.write_bytes(b"\x1f\x8b this is not gzip data at all")
    docs, dead = _read(p)
    assert docs == [] and [d["reason"] for d in dead] == [readers.UNREADABLE_FILE]
    q = tmp_path / "f.csv"
    q.write_text("a,b\n")
    assert [d["reason"] for d in _read(q)[1]] == [readers.UNKNOWN_FORMAT]


def test_missing_file_is_unreadable(tmp_path):
    docs, dead = _read(tmp_path / "gone.txt")
    assert docs == [] and dead[0]["reason"] == readers.UNREADABLE_FILE
    assert "gone.txt" in dead[0]["file"]


def test_parquet_string_and_binary_columns(tmp_path):
    p = tmp_path / "g.parquet"
    pq.write_table(pa.table({"text": ["alpha", None, "", "beta"], "n": [1, 2, 3, 4]}), p)
    docs, dead = _read(p)
    assert docs == [readers.Doc("g.parquet:0", "alpha"), readers.Doc("g.parquet:3", "beta")]
    assert [(d["reason"], d["row"]) for d in dead] == [
        (readers.EMPTY_DOCUMENT, 1),
        (readers.EMPTY_DOCUMENT, 2),
    ]
    assert [d["reason"] for d in _read(p, text_field="n")[1]] == [readers.BAD_FIELD_TYPE]
    assert [d["reason"] for d in _read(p, text_field="body")[1]] == [readers.MISSING_FIELD]
    b = tmp_path / "h.parquet"
    pq.write_table(pa.table({"text": pa.array([b"ok", b"\xff\xfe"], pa.binary())}), b)
    docs, dead = _read(b)
    assert docs == [readers.Doc("h.parquet:0", "ok")]
    assert [(d["reason"], d["row"], d["field"]) for d in dead] == [(readers.UNDECODABLE, 1, "text")]
    c = tmp_path / "i.parquet"
    c.write_bytes(b"PAR1 garbage")
    assert [d["reason"] for d in _read(c)[1]] == [readers.UNREADABLE_FILE]


def test_config_validation():
    with pytest.raises(ValueError, match="txt_mode"):
        readers.ReaderConfig(txt_mode="lines")
    with pytest.raises(ValueError, match="text_field"):
        readers.ReaderConfig(text_field="")


def test_doc_ids_and_glob_base():
    assert readers.glob_base("data/*/x.jsonl") == "data"
    assert readers.glob_base("/a/b/c*.txt") == "/a/b"
    assert readers.glob_base("*.txt") == ""
    ids = readers.doc_ids_for(["/d/a/x.txt", "/d/b/x.txt", "/d/a/y.txt"], ["/d/a", "/d/b", "/d/a"])
    assert ids == {"/d/a/x.txt": "/d/a/x.txt", "/d/b/x.txt": "/d/b/x.txt", "/d/a/y.txt": "y.txt"}


def test_jsonl_byte_ranges_read_like_the_whole_file(tmp_path):
    """Ranges cut at line starts, each knowing its first row: same documents, ids and dead
    letters (rows, lines) as one whole-file read, for any range size."""
    p = tmp_path / "r.jsonl"
    lines = []
    for i in range(300):
        if i % 37 == 5:
            lines.append(b"{broken")
        elif i % 53 == 7:
            lines.append(b"")
        else:
            lines.append(json.dumps({"text": f"row {i} caf\u00e9 " + "x" * (i % 17)}).encode())
    p.write_bytes(b"\n".join(lines) + b"\n")
    whole = list(readers.read_file(str(p), "r.jsonl", readers.ReaderConfig()))
    size = p.stat().st_size
    for split_bytes in (50, 333, 4096, size):
        splits = readers.plan_splits(str(p), size, split_bytes)
        assert splits[0].start == 0 and splits[-1].end is None
        assert all(a.end == b.start for a, b in zip(splits, splits[1:]))
        got, consumed = [], 0
        for sp in splits:
            pos = readers.Position()
            got += list(
                readers.read_file(str(p), "r.jsonl", readers.ReaderConfig(), split=sp, pos=pos)
            )
            consumed += pos.bytes
        assert got == whole and consumed == size, split_bytes
    assert readers.splittable(str(p)) and not readers.splittable(str(tmp_path / "r.jsonl.gz"))
