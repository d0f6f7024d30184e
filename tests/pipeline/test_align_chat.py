"""The align job on conversations, end to end: ``messages`` and prompt/completion rows (jsonl and
parquet, one format per file, detected) -> schema-2 shards, stats.json, dead letters.

One CLI run (`align_job.run`, Beam's in-process runner) over the shipped example conversations
plus one bad row of every kind, a multi-turn conversation over the token limits (kept as its
latest turns, ``--long-conversations keep_suffix``) and a single turn no suffix can save.
Checked from the shards alone, with the tokenizers' own byte tables:

- round trip: per row, the student tokens with a train code decode to exactly the assistant
  contents (prompt/completion rows: the completion) each followed by ``<|im_end|>``; the
  teacher's to the same contents each followed by ``<end_of_turn>``;
- every text chunk covers the same bytes on both sides, and the text chunks of a row, in
  order, spell exactly the messages' contents: no scaffolding (headers, the default system text
  SmolLM2's template injects, BOS) is ever in a content chunk;
- stats.json names each side's template and its sha256; dead letters carry file, row, field and
  reason, counted by reason.

The template refusals (a template that drops a message or rewrites a content) and the default
``too_long`` are checked on `AlignChatDoFn` called directly, with a template file written here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.align import job as align_job
from pipelines.align.chat_dofns import AlignChatDoFn, ChatConfig, RowBatch
from pipelines.align.chat_read import Row
from tests.e2e.helpers import example_rows
from tokenbridge.alignment import WindowConfig
from tokenbridge.chat import rows
from tokenbridge.chat.templates import ChatTemplate, resolve_template, shipped_template
from tokenbridge.formats import shard_schema, shards

LIMIT = 512  # tokens, both sides

BAD_ROWS = [  # (line in a.jsonl, reason, field); a.jsonl starts with 8 good rows
    ('{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     rows.UNKNOWN_ROLE, "messages[0].role"),
    ('{"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]}',
     rows.NON_STRING_CONTENT, "messages[0].content"),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}',
     rows.EMPTY_ASSISTANT, "messages[1].content"),
    ('{"messages": [{"role": "user", "content": "Hi"}]}', rows.NOTHING_TO_TRAIN, "messages"),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",'
     ' "tool_calls": [{"name": "f"}]}]}', rows.TOOL_CALLS, "messages[1].tool_calls"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "y"}]}',
     rows.UNDECODABLE, "messages[0].content"),
    # Gemma's template raises on a tool turn
    ('{"messages": [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "12 C"},'
     ' {"role": "assistant", "content": "Mild."}]}', rows.TEMPLATE_ERROR, "messages"),
    ("{not json", "bad_json", None),
]  # fmt: skip


def _long_rows() -> list[dict]:
    """A conversation of 5 rounds of ~300 tokens (its last round fits the limits, the whole does
    not) and one single turn of ~1000 tokens (nothing to keep: too long)."""
    replies = [m["content"] for r in example_rows(122) for m in r["messages"]
               if m["role"] == "assistant"]  # fmt: skip
    speeches, cur = [], ""
    for x in replies:  # consecutive replies joined into speeches of >= 1200 characters
        cur = f"{cur} {x}" if cur else x
        if len(cur) >= 1200:
            speeches, cur = [*speeches, cur], ""
    msgs = [{"role": "system", "content": "Answer with the lines of the play."}]
    for i, a in enumerate(speeches[:5]):
        msgs += [{"role": "user", "content": f"Speech {i}?"}, {"role": "assistant", "content": a}]
    giant = " ".join(speeches[5:9])
    return [{"messages": msgs}, {"messages": [{"role": "user", "content": "All?"},
                                              {"role": "assistant", "content": giant}]}]  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory, pair_paths, pair_tokenizers):
    t, s = pair_paths
    root = tmp_path_factory.mktemp("chat_job")
    data = root / "data"
    data.mkdir()
    good = example_rows(8)
    long_rows = _long_rows()
    lines = [json.dumps(r) for r in good] + [x for x, _, _ in BAD_ROWS]
    lines += [json.dumps(r) for r in long_rows]
    (data / "a.jsonl").write_text("\n".join(lines) + "\n")
    pc = example_rows(12, fmt="prompt_completion")
    listed = [r for r in pc if isinstance(r["prompt"], list)][:4]
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in ("prompt", "completion")}
                                         for r in listed]), data / "b.parquet")  # fmt: skip
    (data / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pc[:6]))
    out = root / "out"
    argv = ["--data", f"{data}/*", "--teacher", t, "--teacher-chat-template", "gemma"]
    argv += ["--student", s, "--out", str(out), "--long-conversations", "keep_suffix"]
    argv += ["--max-student-tokens", str(LIMIT), "--max-teacher-tokens", str(LIMIT)]
    stats = align_job.run([*argv, "--direct_num_workers", "1"])
    expect = {f"a.jsonl:{i}": r["messages"] for i, r in enumerate(good)}
    for i, r in enumerate(listed):
        expect[f"b.parquet:{i}"] = r["prompt"] + r["completion"]
    for i, r in enumerate(pc[:6]):
        as_list = [
            [{"role": role, "content": x}] if isinstance(x, str) else x
            for role, x in (("user", r["prompt"]), ("assistant", r["completion"]))
        ]
        expect[f"c.jsonl:{i}"] = as_list[0] + as_list[1]
    n_good = len(good) + len(BAD_ROWS)
    return {"stats": stats, "out": out, "expect": expect, "n_good": n_good, "long": long_rows}


def _bytes(tok) -> list[bytes]:
    """Each id's bytes; a special token as its text."""
    return [b if b is not None else (tok.special_content(i) or "").encode()
            for i, b in enumerate(tok.token_bytes())]  # fmt: skip


def _runs(ids, codes, table) -> list[bytes]:
    """The bytes of each maximal run of tokens with a train code > 0."""
    out, cur = [], None
    for x, c in zip(ids, codes):
        if c > 0:
            cur = (cur or b"") + table[x]
        elif cur is not None:
            out, cur = [*out, cur], None
    return out if cur is None else [*out, cur]


def test_rows_round_trip_and_chunks_hold_only_contents(job, pair_tokenizers):
    t_tok, s_tok = pair_tokenizers
    sb, tb = _bytes(s_tok), _bytes(t_tok)
    shard_set = shards.open_shards(job["out"], student=s_tok.info(), teachers=[t_tok.info()])
    assert shard_set.meta.schema_version == shard_schema.SCHEMA_VERSION == 2
    assert shard_set.meta.chat["train_on"] == rows.TRAIN_ASSISTANT
    table = shard_set.table()
    got = {d.rsplit("/", 1)[-1]: i for i, d in enumerate(table.column("doc_id").to_pylist())}
    long_id = f"a.jsonl:{job['n_good']}"
    assert set(got) == {*job["expect"], long_id}
    for doc, i in got.items():
        row = {name: table.column(name)[i].as_py() for name in table.schema.names}
        msgs = json.loads(row["messages"])
        if doc == long_id:  # the system turn and the last round
            assert msgs == job["long"][0]["messages"][:1] + job["long"][0]["messages"][-2:]
        else:
            assert msgs == job["expect"][doc], doc
        replies = [m["content"].encode() for m in msgs if m["role"] == "assistant"]
        assert row["trained_bytes"] == sum(len(x) for x in replies)
        ids, codes = row["student_ids"], row["student_train"]
        assert len(ids) <= LIMIT and len(row["teacher0_ids"]) <= LIMIT
        assert _runs(ids, codes, sb) == [x + b"<|im_end|>" for x in replies], doc
        t_ids = row["teacher0_ids"]
        assert _runs(t_ids, row["teacher0_train"], tb) == [x + b"<end_of_turn>" for x in replies]
        assert row["text"] == s_tok.decode(ids) and row["char_end"] == len(row["text"])
        s_chunk, t_chunk = np.array(row["teacher0_student_chunk"]), np.array(row["teacher0_chunk"])
        kinds = row["teacher0_chunk_kind"]
        assert len(kinds) == row["teacher0_n_chunks"]
        spelled = b""
        for c, kind in enumerate(kinds):
            s_part = b"".join(sb[ids[j]] for j in np.flatnonzero(s_chunk == c))
            t_part = b"".join(tb[t_ids[j]] for j in np.flatnonzero(t_chunk == c))
            if kind < shard_schema.CHUNK_OPEN:  # a text chunk: the same bytes on both sides
                assert s_part == t_part and s_part, (doc, c)
                spelled += s_part
            else:  # a marker pair: each side's own control tokens
                want = {shard_schema.CHUNK_OPEN: (b"<|im_start|>", b"<start_of_turn>"),
                        shard_schema.CHUNK_EOT: (b"<|im_end|>", b"<end_of_turn>")}[kind]  # fmt: skip
                assert (s_part, t_part) == want, (doc, c)
        assert spelled == "".join(m["content"] for m in msgs).encode(), doc
        # SmolLM2 injects its default system text when there is none: scaffolding, untrained
        assert ("You are a helpful AI assistant" in row["text"]) == (msgs[0]["role"] != "system")


def test_stats_name_templates_and_count_dead_letters(job, pair_paths):
    t, s = pair_paths
    stats = job["stats"]
    on_disk = json.loads((job["out"] / shard_schema.STATS_FILE).read_text())
    chat = on_disk["chat"]
    gemma = shipped_template("gemma")
    assert chat["templates"]["teachers"] == [
        {"name": "gemma", "source": "shipped", "sha256": gemma.sha256}
    ]
    jinja = Path(s) / "chat_template.jinja"
    assert chat["templates"]["student"] == {
        "name": resolve_template(s).name,
        "source": "chat_template.jinja",
        "sha256": hashlib.sha256(jinja.read_bytes()).hexdigest(),
    }
    assert gemma.sha256 == hashlib.sha256(gemma.text.encode()).hexdigest()
    n_rows = len(job["expect"]) + 1
    assert chat["conversations"] == on_disk["documents"] == on_disk["windows"] == n_rows
    assert chat["truncated_conversations"] == 1 and chat["long_conversations"] == "keep_suffix"
    assert chat["eot_pairs"] == chat["open_pairs"] and chat["eot_pairs"][0] > n_rows
    assert chat["loose_tokens"] == [0]
    n_msgs = sum(len(m) for m in job["expect"].values()) + 3  # the long one: system + a round
    untouched = {"none": n_msgs, "lstrip": 0, "rstrip": 0, "trim": 0}
    assert chat["content_rewrites"] == {"student": untouched, "teachers": [untouched]}
    assert on_disk["chat_meta"]["teachers"][0]["markers"]["close"] == ["<end_of_turn>"]
    # dead letters: file, row, field, reason of each; counted by reason
    want = [("a.jsonl", 8 + k, field, reason) for k, (_, reason, field) in enumerate(BAD_ROWS)]
    want.append(("a.jsonl", job["n_good"] + 1, "messages", rows.TOO_LONG))
    lines = [
        json.loads(x) for x in (job["out"] / shard_schema.DEAD_LETTER_FILE).read_text().splitlines()
    ]
    got = [(d["file"].rsplit("/", 1)[-1], d["row"], d["field"], d["reason"]) for d in lines]
    assert sorted(got, key=str) == sorted(want, key=str)
    assert all(d["detail"] for d in lines)
    too_long = next(d for d in lines if d["reason"] == rows.TOO_LONG)
    assert f"limits {LIMIT}" in too_long["detail"] and "keep_suffix" in too_long["detail"]
    by_reason: dict[str, int] = {}
    for *_, reason in want:
        by_reason[reason] = by_reason.get(reason, 0) + 1
    assert stats["drops_by_reason"] == by_reason == on_disk["drops_by_reason"]


DROP_SYSTEM_TRIM = (  # a ChatML that leaves out system turns, trims contents, replaces tabs
    "{% for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n"
    "{{ m.content | trim | replace('\t', ' ') }}<|im_end|>\n{% endif %}{% endfor %}"
)


def test_template_refusals_and_too_long_on_the_dofn(student_dir):
    s = str(student_dir)
    chat = ChatConfig(
        student_template=resolve_template(s),
        teacher_templates=(ChatTemplate("drop_system_trim", "file", DROP_SYSTEM_TRIM),),
    )
    fn = AlignChatDoFn(s, [s], chat=chat, window=WindowConfig(64, 64))
    fn.setup()
    convs = [
        [("user", "Who?"), ("assistant", "Bernardo.")],  # written
        [("system", "Be brief."), ("user", "Who?"), ("assistant", "Bernardo.")],  # dropped
        [("user", " Who? "), ("assistant", "Bernardo.\n")],  # trimmed: located, written
        [("user", "Who?\tYou?"), ("assistant", "Bernardo.")],  # a tab replaced: rewritten
        [("user", "Who?"), ("assistant", " ".join(["Bernardo."] * 40))],  # > 64 tokens
    ]
    batch = RowBatch("f.jsonl", [
        Row(f"f.jsonl:{i}", i, {"messages": [{"role": r, "content": c} for r, c in m]}, rows.MESSAGES)
        for i, m in enumerate(convs)
    ])  # fmt: skip
    out = list(fn.process(batch))
    written = [w for tag, w in out if tag == "main"]
    assert [d for w in written for d in w.batch.column("doc_id").to_pylist()] == [
        "f.jsonl:0",
        "f.jsonl:2",
    ]
    dead = sorted((d["row"], d["reason"], d["field"]) for tag, d in out if tag != "main")
    assert dead == [
        (1, rows.TEMPLATE_DROPPED, "messages[0].content"),
        (3, rows.TEMPLATE_REWROTE, "messages"),
        (4, rows.TOO_LONG, "messages"),
    ]
    details = {d["row"]: d["detail"] for tag, d in out if tag != "main"}
    assert details[1].startswith("teacher0") and "message 0 (system)" in details[1]
    assert "--long-conversations keep_suffix" in details[4]
    # per side, which contents lost edge whitespace: the teacher's " Who? " (both edges) and
    # "Bernardo.\n" (its end); the student's template keeps every content whole
    rewrites = sum(fn.layout.get(w.stats, "content_rewrites") for w in written).reshape(2, 4)
    assert rewrites.tolist() == [[4, 0, 0, 0], [2, 0, 1, 1]]  # none, lstrip, rstrip, trim
    trained = [
        b for w in written for b in w.batch.column(shard_schema.TRAINED_BYTES_COLUMN).to_pylist()
    ]
    assert trained == [len("Bernardo."), len("Bernardo.\n")]  # as the student sees them
