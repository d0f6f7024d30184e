"""What several benchmark sections and the tests share: the demo pair's projection (made from the
tokenizers alone), the shipped corpus's text and example conversations (and a conversation
shard directory of them, `write_chat_shards`), trainer runs and their per-step figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tokenbridge import paths

PROJECTION = (
    paths.REPO_ROOT / "outputs" / "projection" / "gemma-3-270m__smollm2-135m__k8.safetensors"
)


def ensure_projection(
    teacher_dir: str | os.PathLike | None = None, student_dir: str | os.PathLike | None = None
) -> Path:
    """`PROJECTION` (the `make projection` file of the pair, k=8; by default the shipped
    teacher's and student's), built if missing or made for other tokenizers. The tokenizer files
    are all it reads."""
    from pipelines.projection.__main__ import main as projection_job
    from tokenbridge import projection
    from tokenbridge.tokenizers import load_tokenizer

    t_dir, s_dir = teacher_dir or paths.teacher_dir(), student_dir or paths.student_dir()
    try:
        projection.load_projection(
            PROJECTION, teacher=load_tokenizer(t_dir).info(), student=load_tokenizer(s_dir).info()
        )
    except (FileNotFoundError, ValueError):
        projection_job(["--teacher", str(t_dir), "--student", str(s_dir), "--k", "8",
                "--out", str(PROJECTION)])  # fmt: skip
    return PROJECTION


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


def shakespeare_text(chars: int, *, skip: int = 3000) -> str:
    """`chars` characters of the shipped plays, in file order, past each one's front matter."""
    parts, n = [], 0
    for f in sorted((paths.corpus_dir() / "shakespeare").glob("*.txt")):
        text = f.read_text(encoding="utf-8")[skip:]
        parts.append(text[: chars - n])
        n += len(parts[-1])
        if n >= chars:
            return "".join(parts)
    raise ValueError(f"{paths.corpus_dir() / 'shakespeare'}: fewer than {chars} characters")


def short_documents(copies: int, *, min_chars: int = 260) -> list[str]:
    """Many short documents (issue 29's shape, ~300 characters): consecutive KJV verses joined
    until a document has `min_chars`, over `copies` passes of the KJV."""
    src = paths.corpus_dir() / "kjv.jsonl"
    verses = [json.loads(x)["text"] for x in src.read_text().splitlines()]
    docs, cur = [], ""
    for v in verses * copies:
        cur = f"{cur} {v}" if cur else v
        if len(cur) >= min_chars:
            docs.append(cur)
            cur = ""
    return docs


def run_trainer(args: list[str], *, nproc: int = 1, timeout: float = 300, env: dict | None = None):
    """Run trainer/main.py (torchrun for nproc > 1) at the repo root; the CompletedProcess."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}"]  # fmt: skip
    else:
        cmd = [sys.executable]
    cmd += [str(paths.REPO_ROOT / "trainer" / "main.py"), *args]
    full_env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    return subprocess.run(
        cmd, cwd=paths.REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


# what a step record may hold besides: model TFLOP/s per device and MFU of the student and of
# the live teachers (trainer.throughput, where the run knows the model's FLOPs and the peak)
OPTIONAL = ("tflops_per_device", "mfu", "teacher_tflops_per_device", "teacher_mfu")


def step_figures(records: Sequence[dict], *, skip: int = 1) -> dict[str, float]:
    """Medians over the trainer's step records after the first `skip` (warm-up: allocation,
    kernels' first calls): seconds per step, the teacher worker's busy seconds, student tokens
    per step and per second, and each of `OPTIONAL` every record has; the largest peak memory
    (GiB) any step reported."""
    kept = list(records[skip:]) or list(records)
    out = {
        "step_s": statistics.median(r["step_s"] for r in kept),
        "teacher_s": statistics.median(r.get("teacher_s", 0.0) for r in kept),
        "tokens": statistics.median(r["tokens"] for r in kept),
        "tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in kept),
        "memory_gib": max(r["memory_gib"] for r in records),
    }
    for key in OPTIONAL:
        if all(key in r for r in kept):
            out[key] = statistics.median(r[key] for r in kept)
    return out


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
    from tokenbridge.formats.shard_schema import shard_schema
    from tokenbridge.formats.shards import ShardWriter, shard_name, write_completed
    from tokenbridge.tokenizers import load_tokenizer

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


def alternated_medians(run, names: Sequence[str], *, reps: int) -> dict[str, float]:
    """Median wall seconds of ``run(name)`` per name: a warm-up of ``run(name, first=1)`` each,
    then `reps` rounds in which the names alternate (the machine's drifts reach both alike)."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        run(name, first=1)
    for _ in range(reps):
        for name, ts in times.items():
            t0 = time.perf_counter()
            run(name)
            ts.append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
