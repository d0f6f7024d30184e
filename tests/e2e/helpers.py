"""Test inputs for the trainer, made with the real pipeline pieces (no Beam, so in seconds).

`write_shards` tokenizes texts with the real tokenizers, aligns and windows them
(`tokenbridge.alignment`: alignment and windows) and writes a complete shard directory with
`tokenbridge.formats.shards` — the same rows the align job writes, minus the Beam runner.
`shakespeare_docs` cuts the shipped corpus into small documents; `real_projection` is the
`make projection` file of the real teacher and student; `identity_projection` maps a tokenizer
onto itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipelines.projection.__main__ import main as projection_job
from tokenbridge import paths
from tokenbridge import projection as P
from tokenbridge.alignment import CHUNK_KIND_NAMES, WindowConfig, align, cut_windows
from tokenbridge.formats.shard_schema import shard_schema
from tokenbridge.formats.shards import ShardWriter, shard_name, window_to_row, write_completed
from tokenbridge.tokenizers import load_tokenizer

REPO = paths.REPO_ROOT
PROJECTION = REPO / "outputs" / "projection" / "gemma-3-270m__smollm2-135m__k8.safetensors"


def shakespeare_docs(n_docs: int, *, chars: int = 1500, skip: int = 3000) -> list[tuple[str, str]]:
    """(doc id, text) pairs: `chars`-long slices of the shipped plays (past their front matter)."""
    files = sorted((paths.corpus_dir() / "shakespeare").glob("*.txt"))
    docs = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        for j in range(skip, len(text) - chars, chars):
            docs.append((f"{f.stem}/{j}", text[j : j + chars]))
            if len(docs) == n_docs:
                return docs
    return docs


def write_shards(
    out_dir: str | os.PathLike,
    docs: list[tuple[str, str]],
    *,
    student_dir: str | os.PathLike,
    teacher_dirs: list[str | os.PathLike],
    max_tokens: int = 64,
    num_files: int = 2,
) -> Path:
    """A complete shard directory of `docs`, windows of at most `max_tokens` on every side."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    student = load_tokenizer(student_dir)
    teachers = [load_tokenizer(t) for t in teacher_dirs]
    config = WindowConfig(max_student_tokens=max_tokens, max_teacher_tokens=max_tokens)
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
        "window_config": {"max_student_tokens": max_tokens, "max_teacher_tokens": max_tokens},
        # as the align job counts them (per document, before windowing): the run report plots them
        "chunk_kinds": [dict(zip(CHUNK_KIND_NAMES, map(int, k))) for k in kinds],
    }
    write_completed(out, stats, files=files)
    return out


def real_projection(teacher_dir: str | os.PathLike, student_dir: str | os.PathLike) -> Path:
    """`PROJECTION`, the real teacher -> student projection (k=8), built once if missing or
    made for other tokenizers."""
    try:
        P.load_projection(PROJECTION, teacher=load_tokenizer(teacher_dir).info(),
                          student=load_tokenizer(student_dir).info())  # fmt: skip
    except (FileNotFoundError, ValueError):
        projection_job(["--teacher", str(teacher_dir), "--student", str(student_dir), "--k", "8",
                "--out", str(PROJECTION)])  # fmt: skip
    return PROJECTION


def identity_projection(tokenizer_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """A k=2 projection of a tokenizer onto itself (rows padded to 49152), saved at ``out``."""
    tok = load_tokenizer(tokenizer_dir)
    return P.save_projection(
        P.build_projection(tok, tok, k=2, teacher_rows=49152, student_rows=49152), out
    )


def run_trainer(args: list[str], *, nproc: int = 1, timeout: float = 300, env: dict | None = None):
    """Run trainer/main.py (torchrun for nproc > 1); returns the CompletedProcess."""
    py = sys.executable
    if nproc > 1:
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        cmd = [py]
    cmd += [str(REPO / "trainer" / "main.py"), *args]
    full_env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    return subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def example_rows(n: int, *, fmt: str = "messages") -> list[dict]:
    """The first `n` rows of a shipped example conversation file (`tokenbridge.chat.example`)."""
    from tokenbridge.chat import example

    name = example.MESSAGES_FILE if fmt == "messages" else example.PROMPT_COMPLETION_FILE
    lines = (example.DATA_DIR / name).read_text(encoding="utf-8").splitlines()
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
    from tokenbridge.chat import rows as R
    from tokenbridge.chat.align import align_conversations, prepare_side
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
    convs = [R.parse_row(r, fmt=R.detect_format(r), train_on=train_on) for r in rows]
    bad = [c for c in convs if isinstance(c, R.DeadLetter)]
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
