"""A complete shard directory from a few texts, aligned in this process (no Beam).

The align job's rows for inputs that fit in memory (the tests' and benchmarks' shards, a quick
experiment); large corpora go through the job (``make align``), which streams, parallelises and
keeps dead letters.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tokenbridge.alignment.chunks import CHUNK_KIND_NAMES, align
from tokenbridge.alignment.windows import WindowConfig, cut_windows
from tokenbridge.formats.shard_schema import shard_schema
from tokenbridge.formats.shards import ShardWriter, shard_name, window_to_row, write_completed
from tokenbridge.tokenizers import load_tokenizer


def write_text_shards(
    out_dir: str | os.PathLike,
    docs: Sequence[tuple[str, str]],
    *,
    student_dir: str | os.PathLike,
    teacher_dirs: Sequence[str | os.PathLike],
    max_tokens: int = 64,
    max_teacher_tokens: int | None = None,
    num_files: int = 2,
) -> Path:
    """A complete shard directory of `docs` ((doc id, text) pairs) for the student and teacher
    tokenizers: windows of at most `max_tokens` student tokens and `max_teacher_tokens` (by
    default `max_tokens`) on every teacher side, spread over `num_files` files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    student = load_tokenizer(student_dir)
    teachers = [load_tokenizer(t) for t in teacher_dirs]
    max_teacher = max_tokens if max_teacher_tokens is None else max_teacher_tokens
    config = WindowConfig(max_student_tokens=max_tokens, max_teacher_tokens=max_teacher)
    rows = []
    kinds = np.zeros((len(teachers), len(CHUNK_KIND_NAMES)), dtype=np.int64)
    for doc_id, text in docs:
        s_enc = student.encode(text)
        t_parts = []
        for i, t in enumerate(teachers):
            t_enc = t.encode(text)
            al = align(s_enc, t_enc)
            counts = np.bincount(al.chunk_kind.astype(np.int64), minlength=kinds.shape[1])
            kinds[i] += counts[: kinds.shape[1]]
            t_parts.append((t, t_enc, al))
        for w in cut_windows(text, student=(student, s_enc), teachers=t_parts, config=config):
            rows.append(window_to_row(doc_id, w))
    schema = shard_schema(student.info(), [t.info() for t in teachers])
    files = {}
    per = -(-len(rows) // num_files)
    for i in range(num_files):
        name = shard_name(i, num_files)
        with ShardWriter(out / name, schema) as w:
            w.write_rows(rows[i * per : (i + 1) * per])
        files[name] = len(rows[i * per : (i + 1) * per])
    stats = {
        "student": student.info().to_json(),
        "teachers": [t.info().to_json() for t in teachers],
        "windows": len(rows),
        "window_config": {"max_student_tokens": max_tokens, "max_teacher_tokens": max_teacher},
        # as the align job counts them (per document, before windowing): the run report plots them
        "chunk_kinds": [dict(zip(CHUNK_KIND_NAMES, map(int, k))) for k in kinds],
    }
    write_completed(out, stats, files=files)
    return out
