"""Packed rows vs padded microbatches over the same conversations (issue 43).

Every shipped example conversation (messages and prompt/completion), aligned by the align job's
pure steps (SmolLM2-135M student with its own template, Gemma-3-270M teacher with the shipped
``gemma`` template), shuffled once (the same order both ways), at an equal budget of positions
per microbatch: padded, ``ROWS`` rows padded to the longest (`collate`: at most ``ROWS`` x the
longest conversation); packed, ``PACKED_ROWS`` rows of ``packed_tokens`` = (ROWS / PACKED_ROWS)
x the longest conversation, packed as `PackedLoader` packs (`pack_documents`: best-fit over the
trainer's default buffer, every document once, the last rows partial). The padding is counted
over every microbatch of every conversation; the wall time over the first ``DOCS`` of them,
each microbatch's compute as a step does it: the teacher's forward (`teacher_forward`, alm
outputs at every position), the student's forward and backward with CE (`model_inputs`). The
two passes alternate, repeat by repeat.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.common import alternated_medians
from bench.provenance import cpu_model
from tokenbridge import paths

MEASURES = (
    "trainer/data",
    "trainer/parallel/cp_attention.py",
    "tokenbridge/teacher/forward.py",
    "bench/training/packed_rows.py",
    "bench/common.py",
)

PER_FILE = 122  # the shipped files' conversations (each file's count; fewer if it holds fewer)
DOCS = int(os.environ.get("TOKENBRIDGE_PACKING_DOCS", "48"))  # conversations timed per pass
ROWS = 4  # padded rows per microbatch
PACKED_ROWS = 2  # packed rows per microbatch, each (ROWS / PACKED_ROWS) x the longest
REPS = 2
THREADS = 2
PADS = {"student_pad": 2, "teacher_pads": [0], "pad_to_multiple": 8}


def _documents(tmp: Path) -> list[dict]:
    """The shipped example conversations as shards, read back, in one shuffled order."""
    from bench.common import example_rows, write_chat_shards
    from tokenbridge.formats.shards import open_shards
    from trainer.data.shard_reader import ShardReader

    rows = example_rows(PER_FILE) + example_rows(PER_FILE, fmt="prompt_completion")
    out = write_chat_shards(tmp / "chat", rows, student_dir=paths.student_dir(),
                            teachers=[(paths.teacher_dir(), "gemma")])  # fmt: skip
    reader = ShardReader(open_shards(out), max_student_tokens=4096)
    order = np.random.default_rng(0).permutation(reader.num_rows)
    return [reader.row(int(i)) for i in order]


def _microbatches(docs: list[dict], *, longest: tuple[int, int]) -> dict[str, list]:
    """Both layouts of ``docs``; ``longest``: the longest conversation's (student, teacher)
    tokens over all of them, which sizes the packed rows (as data.max_student_tokens would)."""
    from trainer.config.sections import DataConfig
    from trainer.data.microbatches import collate
    from trainer.data.packing import (
        PackLimits,
        pack_documents,
        pack_row,
        row_lengths,
        teacher_limits,
    )

    padded = [collate(docs[i : i + ROWS], **PADS) for i in range(0, len(docs), ROWS)]
    tokens = ROWS // PACKED_ROWS * longest[0]
    limits = PackLimits(tokens, teacher_limits(tokens, student_max=longest[0],
                                               teacher_max=[longest[1]]))  # fmt: skip
    groups = pack_documents([row_lengths(d) for d in docs], limits,
                            buffer=DataConfig.pack_buffer)  # fmt: skip
    rows = [pack_row([docs[i] for i in g]) for g in groups]
    packed = [collate(rows[i : i + PACKED_ROWS], **PADS) for i in range(0, len(rows), PACKED_ROWS)]
    return {"padded": padded, "packed": packed}


def _padding(mbs) -> tuple[float, int, int]:
    positions = sum(mb.input_ids_BT.numel() for mb in mbs)
    tokens = sum(int(mb.attention_mask_BT.sum()) for mb in mbs)
    return 1.0 - tokens / positions, positions, tokens


def main() -> str:
    from tokenbridge import models
    from tokenbridge.losses.alm import AlmConfig, alm_teacher_spec
    from tokenbridge.tokenizers import load_tokenizer
    from trainer.config.schema import ModelConfig, TeacherConfig
    from trainer.data.packing import row_lengths
    from trainer.loss_terms import ce_term
    from trainer.parallel.cp_attention import model_inputs
    from trainer.parallel.head import student_logits
    from trainer.teacher.model_program import teacher_forward

    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        docs = _documents(Path(tmp))
    longest = tuple(int(x) for x in np.max([row_lengths(d) for d in docs], axis=0))
    every = _microbatches(docs, longest=longest)
    mbs = _microbatches(docs[:DOCS], longest=longest)
    vs = load_tokenizer(paths.student_dir()).vocab_size
    vt = load_tokenizer(paths.teacher_dir()).vocab_size
    student = models.build_model(ModelConfig(path=str(paths.student_dir())))
    teacher = models.freeze(models.build_model(TeacherConfig(path=str(paths.teacher_dir()))))
    spec = alm_teacher_spec(AlmConfig(), teacher_vocab_size=vt)
    losses: dict[str, float] = {}

    def run(name: str, *, first: int | None = None) -> None:
        total = 0.0
        for mb in mbs[name][:first]:
            t_in = mb.teacher_inputs(0)
            with torch.no_grad():
                teacher_forward(teacher, t_in["input_ids"], t_in["attention_mask"], spec=spec,
                                columns=None, chunk=128, position_ids_BU=t_in.get("position_ids"))  # fmt: skip
            logits = student_logits(student, model_inputs(mb.student_rows(), group=None), chunk=0)
            out = ce_term(logits, mb, vocab_size=vs)
            out.sum.backward()
            student.zero_grad(set_to_none=True)
            total += float(out.sum.detach())
        if first is None:
            losses[name] = total

    # warm-up: one microbatch each, then the two alternate
    wall = alternated_medians(run, ("padded", "packed"), reps=REPS)
    lens = [len(d["student_ids"]) for d in docs]
    lines = [
        "## Packed rows vs padded microbatches (issue 43)",
        "",
        f"{len(docs)} conversations (every shipped example, messages and prompt/completion, "
        f"shuffled once: {min(lens)}-{max(lens)} student tokens, mean "
        f"{statistics.fmean(lens):.0f}), SmolLM2-135M-Instruct student, Gemma-3-270M teacher "
        f"(shipped `gemma` template), fp32, {THREADS} torch threads. An equal budget of "
        f"{ROWS * longest[0]:,} student positions per microbatch: padded, {ROWS} rows padded to "
        f"the longest of them (at most {longest[0]}, the longest conversation); packed, "
        f"{PACKED_ROWS} rows of up to {ROWS // PACKED_ROWS * longest[0]} student tokens "
        "(`data.packed_tokens`), filled as the trainer's loader fills them (best-fit over its "
        "default buffer, every conversation once, the last rows partial), padded to the longer "
        "of the two. Padding over every microbatch of all "
        f"{len(docs)} conversations; wall time over the first {min(DOCS, len(docs))} (the same "
        "conversations both ways, packed on their own): per microbatch, the teacher's forward "
        "(alm outputs at every position) and the student's forward + backward with CE, as the "
        f"trainer runs them. The two passes alternate, median of {REPS} after a warm-up "
        f"microbatch each. CPU: {cpu_model()}, {os.cpu_count()} cores.",
        "",
        "| layout | conversations | microbatches | positions computed | tokens | padding | wall s | CE sum |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("padded", "packed"):
        pad, positions, tokens = _padding(every[name])
        lines.append(f"| {name} | {len(docs)} | {len(every[name])} | {positions:,} | "
                     f"{tokens:,} | {pad:.1%} | | |")  # fmt: skip
    for name in ("padded", "packed"):
        pad, positions, tokens = _padding(mbs[name])
        lines.append(
            f"| {name}, timed | {min(DOCS, len(docs))} | {len(mbs[name])} | {positions:,} | "
            f"{tokens:,} | {pad:.1%} | {wall[name]:.1f} | {losses[name]:.2f} |"
        )
    pad_p = _padding(every["packed"])[0]
    ratio = wall["padded"] / wall["packed"]
    lines += [
        "",
        f"Packed: {ratio:.2f}x faster than padded over the same conversations (goal >= 1.35x: "
        f"{'met' if ratio >= 1.35 else 'not met'}); padding {pad_p:.1%} of the positions "
        f"computed over all {len(docs)} (goal <= 5%: {'met' if pad_p <= 0.05 else 'not met'}). "
        "The CE sums agree (the same targets, each within its own conversation).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
