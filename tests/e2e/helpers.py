"""Test inputs for the trainer, made with the real pipeline pieces (no Beam, so in seconds).

`write_shards` tokenizes texts with the real tokenizers, aligns and windows them
(`pipelines.align`: alignment and windows) and writes a complete shard directory with
`pipelines.shards` — the same rows the align job writes, minus the Beam runner.
`shakespeare_docs` cuts the shipped corpus into small documents.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipelines import paths
from pipelines.align import CHUNK_KIND_NAMES, WindowConfig, align, cut_windows
from pipelines.schema import shard_schema
from pipelines.shards import ShardWriter, shard_name, window_to_row, write_completed
from pipelines.tokenizers import load_tokenizer

REPO = paths.REPO_ROOT


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
        # as the align job counts them (per document, before windowing): the run report plots them
        "chunk_kinds": [dict(zip(CHUNK_KIND_NAMES, map(int, k))) for k in kinds],
    }
    write_completed(out, stats, files=files)
    return out


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
