"""The demo pair's trainer inputs and step figures, shared by `bench_trainer` and `gpu_check`.

Both benchmarks train SmolLM2-shaped students from Gemma-3-shaped teachers on aligned shards of
the shipped Shakespeare corpus, through the xtoken projection of the real tokenizers, and both
read the trainer's per-step records the same way (the first steps dropped as warm-up, medians
of the rest). Built here once: the projection (made from the tokenizers alone, so it needs no
weights: a GPU machine without them builds it in seconds), the shards (the align job's rows, cut
and aligned in-process, without Beam), and the figures of a list of step records.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from tokenbridge import paths

PROJECTION = (
    paths.REPO_ROOT / "outputs" / "projection" / "gemma-3-270m__smollm2-135m__k8.safetensors"
)


def ensure_projection(teacher_dir: Path | None = None, student_dir: Path | None = None) -> Path:
    """`PROJECTION` (the `make projection` file of the pair, k=8), built if missing or made for
    other tokenizers. The tokenizer files are all it reads."""
    from pipelines.projection.__main__ import main as projection_job
    from tokenbridge import projection as P
    from tokenbridge.tokenizers import load_tokenizer

    t_dir, s_dir = teacher_dir or paths.teacher_dir(), student_dir or paths.student_dir()
    try:
        P.load_projection(
            PROJECTION, teacher=load_tokenizer(t_dir).info(), student=load_tokenizer(s_dir).info()
        )
    except (FileNotFoundError, ValueError):
        projection_job(["--teacher", str(t_dir), "--student", str(s_dir), "--k", "8",
                "--out", str(PROJECTION)])  # fmt: skip
    return PROJECTION


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


def write_pair_shards(
    out: Path,
    docs: Sequence[tuple[str, str]],
    *,
    s_tok,
    t_tok,
    max_student_tokens: int,
    max_teacher_tokens: int,
) -> dict[str, int]:
    """A complete one-file shard directory of `docs` ((doc id, text) pairs) for the pair of
    tokenizers, windows of at most the given lengths (the align job's rows); returns the rows
    and their student and teacher tokens."""
    from tokenbridge.alignment import WindowConfig, align, cut_windows
    from tokenbridge.formats.shard_schema import shard_schema, teacher_ids_column
    from tokenbridge.formats.shards import ShardWriter, shard_name, window_to_row, write_completed

    cfg = WindowConfig(max_student_tokens=max_student_tokens, max_teacher_tokens=max_teacher_tokens)
    rows = []
    for doc_id, text in docs:
        s_enc, t_enc = s_tok.encode(text), t_tok.encode(text)
        teachers = [(t_tok, t_enc, align(s_enc, t_enc))]
        for w in cut_windows(text, student=(s_tok, s_enc), teachers=teachers, config=cfg):
            rows.append(window_to_row(doc_id, w))
    out.mkdir(parents=True, exist_ok=True)
    with ShardWriter(out / shard_name(0, 1), shard_schema(s_tok.info(), [t_tok.info()])) as w:
        w.write_rows(rows)
    stats = {"student": s_tok.info().to_json(), "teachers": [t_tok.info().to_json()]}
    write_completed(out, stats, files={shard_name(0, 1): len(rows)})
    return {
        "rows": len(rows),
        "student_tokens": sum(len(r["student_ids"]) for r in rows),
        "teacher_tokens": sum(len(r[teacher_ids_column(0)]) for r in rows),
    }


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
