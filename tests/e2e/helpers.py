"""Test inputs the benchmarks do not need (those both use: `bench.common`, and shards from
texts: `tokenbridge.alignment.text_shards`).

`identity_projection` maps a tokenizer onto itself; `example_rows` reads the shipped example
conversations; `write_chat_shards` writes a conversation shard directory with the align job's
pure steps, without Beam.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenbridge import paths, projection
from tokenbridge.formats.shard_schema import shard_schema
from tokenbridge.formats.shards import ShardWriter, shard_name, write_completed
from tokenbridge.tokenizers import load_tokenizer

REPO = paths.REPO_ROOT


def identity_projection(tokenizer_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """A k=2 projection of a tokenizer onto itself (rows padded to 49152), saved at ``out``."""
    tok = load_tokenizer(tokenizer_dir)
    return projection.save_projection(
        projection.build_projection(tok, tok, k=2, teacher_rows=49152, student_rows=49152), out
    )


def example_rows(n: int, *, fmt: str = "messages") -> list[dict]:
    """The first `n` rows of a shipped example conversation file (`tokenbridge.commands.chat_example`)."""
    from tokenbridge.commands import chat_example

    name = chat_example.MESSAGES_FILE if fmt == "messages" else chat_example.PROMPT_COMPLETION_FILE
    lines = (chat_example.DATA_DIR / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(x) for x in lines[:n]]


def write_chat_shards(
    out_dir: str | os.PathLike,
    rows: list[dict],
    *,
    student_dir: str | os.PathLike,
    teachers: list[tuple[str | os.PathLike, str | None]],
    train_on: str = "assistant",
) -> Path:
    """A complete conversation shard directory of `rows` (``messages`` or prompt/completion
    dicts), made by the align job's pure steps (parse, `align_conversations`, `record_batch`)
    without Beam. `teachers`: (model dir, chat template name or None = the model's own)."""
    from pipelines.align import chat_records as records
    from tokenbridge.chat import fit
    from tokenbridge.chat.align import align_conversations, prepare_side
    from tokenbridge.chat.rows import DeadLetter, detect_format, parse_row
    from tokenbridge.chat.templates import resolve_template

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s_tok = load_tokenizer(student_dir)
    t_toks = [load_tokenizer(t) for t, _ in teachers]
    student = prepare_side(s_tok, resolve_template(student_dir))
    sides = [
        prepare_side(tok, resolve_template(t, override=o), name=f"teacher{i}")
        for i, (tok, (t, o)) in enumerate(zip(t_toks, teachers))
    ]
    convs = [parse_row(r, fmt=detect_format(r), train_on=train_on) for r in rows]
    bad = [c for c in convs if isinstance(c, DeadLetter)]
    if bad:
        raise ValueError(f"bad example rows: {bad}")
    batch = align_conversations(convs, student=student, teachers=sides, train_on=train_on)
    if batch.dead:
        raise ValueError(f"refused by a template: {batch.dead}")
    meta = records.chat_meta(student, sides, train_on=train_on, long_conversations=fit.TOO_LONG)
    schema = shard_schema(s_tok.info(), [t.info() for t in t_toks], chat=meta)
    rec = records.record_batch(
        batch, convs, doc_ids=[f"chat:{i}" for i in range(len(convs))], train_on=train_on,
        schema=schema,
    )  # fmt: skip
    name = shard_name(0, 1)
    with ShardWriter(out / name, schema) as w:
        w.write_batch(rec)
    stats = {"student": s_tok.info().to_json(), "teachers": [t.info().to_json() for t in t_toks]}
    write_completed(out, stats, files={name: rec.num_rows})
    return out
