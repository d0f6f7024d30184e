"""Packed vs padded on-policy rollouts (issue 43, item 3): the student's forward and backward.

SmolLM2-135M-Instruct samples completions of the shipped example conversations' prompts
(`ChatPrompts`: the student's template, one prompt per assistant turn), temperature 1, up to
``NEW`` tokens, ending at its end-of-turn or EOS: uneven lengths, as a run's rollouts. The same
rollouts both ways, shuffled once, at an equal budget of student positions per microbatch:
padded, ``ROWS`` rollouts padded to the longest (`build_batch`, onpolicy.micro_batch_size =
ROWS); packed, the rollouts that ``PACKED_ROWS`` rows of (ROWS / PACKED_ROWS) x the longest
rollout hold (`pack_documents` over the trainer's default buffer), each microbatch packed as a
run packs it (`pack_rollouts`). Gemma-3-270M (shipped ``gemma`` template) scores every
microbatch's rollouts unpacked, as a run's teacher does (alm outputs at the positions the loss
reads), outside the timed part: its seconds are reported apart. Timed: the student's forward
(`rollout_logits`, chunked logits), the alm loss and the backward; the two passes alternate.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from bench.common import alternated_medians
from bench.provenance import cpu_model
from tokenbridge import paths

MEASURES = (
    "trainer/onpolicy",
    "trainer/data/packing.py",
    "trainer/data/microbatches.py",
    "trainer/parallel/head.py",
    "bench/onpolicy/rollout_packing.py",
)

ROLLOUTS = int(os.environ.get("TOKENBRIDGE_PACKING_ROLLOUTS", "32"))
NEW = int(os.environ.get("TOKENBRIDGE_PACKING_NEW", "96"))  # onpolicy.max_new_tokens
ROWS = 4  # padded rollouts per microbatch
PACKED_ROWS = 2  # packed rows per microbatch, each (ROWS / PACKED_ROWS) x the longest rollout
REPS = 2
THREADS = 2
CHUNK = 256  # parallel.logits_chunk's default


def _rollouts(student, s_tok):
    """``ROLLOUTS`` sampled rollouts of the shipped conversations' prompts, with their messages
    (each teacher renders them in its own template), and the student's chat side."""
    from tokenbridge.commands import chat_example
    from trainer.config.sections import DataConfig
    from trainer.onpolicy.prompts import ChatPrompts
    from trainer.onpolicy.sampling.sampler import SamplingConfig, sample

    data = DataConfig(shards="/unused", max_student_tokens=512, eval_fraction=0.0)
    source = ChatPrompts(chat_example.DATA_DIR / chat_example.MESSAGES_FILE, s_tok, data=data,
                         model_dir=paths.student_dir(), template=None, dp_rank=0, dp_size=1,
                         seed=0)  # fmt: skip
    prompts = source.next_prompts(ROLLOUTS)
    stops = sorted({s_tok.eos_id, *(int(i) for i in source.side.markers.close_ids)})
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=NEW)
    student.eval()
    with torch.no_grad():
        r = sample(student, [p.ids for p in prompts], config=cfg, seeds=list(range(ROLLOUTS)),
                   stop_ids=stops, vocab_size=s_tok.vocab_size)  # fmt: skip
    student.train()
    r.meta = [{"key": prompts[i].key, "messages": prompts[i].messages} for i in r.prompt_index]
    return r


def _groups(lengths: list[int]) -> dict[str, list[list[int]]]:
    """Each layout's microbatches: lists of rollout indices (a fixed shuffled order)."""
    from trainer.config.sections import DataConfig
    from trainer.data.packing import PackLimits, pack_documents

    order = np.random.default_rng(0).permutation(len(lengths)).tolist()
    padded = [order[i : i + ROWS] for i in range(0, len(order), ROWS)]
    limits = PackLimits(ROWS // PACKED_ROWS * max(lengths), ())
    rows = pack_documents([(lengths[i],) for i in order], limits, buffer=DataConfig.pack_buffer)
    rows = [[order[i] for i in row] for row in rows]
    packed = [sum(rows[i : i + PACKED_ROWS], []) for i in range(0, len(rows), PACKED_ROWS)]
    return {"padded": padded, "packed": packed}


def main() -> str:
    from tokenbridge import models
    from tokenbridge.chat.align import prepare_side
    from tokenbridge.chat.templates import resolve_template
    from tokenbridge.losses.alm import AlmConfig
    from tokenbridge.losses.modes import MODES
    from tokenbridge.teacher.forward import teacher_forward
    from tokenbridge.tokenizers import load_tokenizer
    from trainer.config.schema import ModelConfig, TeacherConfig
    from trainer.loss_terms import used_inputs
    from trainer.onpolicy.packed_rollouts import pack_rollouts, rollout_logits
    from trainer.onpolicy.realign import TeacherView
    from trainer.onpolicy.rollout_scoring import scoring_spec
    from trainer.onpolicy.rollouts import build_batch, completion_rows
    from trainer.onpolicy.teachers import stop_for

    torch.set_num_threads(THREADS)
    s_tok, t_tok = load_tokenizer(paths.student_dir()), load_tokenizer(paths.teacher_dir())
    student = models.build_model(ModelConfig(path=str(paths.student_dir())))
    teacher = models.freeze(models.build_model(TeacherConfig(path=str(paths.teacher_dir()))))
    t0 = time.perf_counter()
    r = _rollouts(student, s_tok)
    sample_s = time.perf_counter() - t0
    side = prepare_side(t_tok, resolve_template(paths.teacher_dir(), override="gemma"))
    view = TeacherView(t_tok, 4096, side, stop_for(t_tok, side))
    record, opts = MODES["alm"], AlmConfig()
    spec = scoring_spec(record.teacher_spec(opts, None, teacher_vocab_size=t_tok.vocab_size))
    lengths = [len(p) + len(c) for p, c in zip(r.prompts, r.completions)]
    groups = _groups(lengths)
    row_tokens = ROWS // PACKED_ROWS * max(lengths)
    mbs: dict[str, list] = {}
    teacher_s: dict[str, float] = {}
    for name, layout in groups.items():
        mbs[name], teacher_s[name] = [], 0.0
        for rows in layout:
            b = build_batch(r, rows, student=s_tok, teachers=[view], want_cols=[False], pad_id=2)
            if name == "packed":
                lens = b.attention_mask_BT.sum(1).tolist()
                b.packed = pack_rollouts(b.input_ids_BT, lens, row_tokens=row_tokens,
                                         buffer=len(rows), pad_id=2)  # fmt: skip
            prep = record.prepare(b.aligned[0], b.targets_BT)
            done = completion_rows(b.aligned[0], b.teacher_inputs[0]["input_ids"].shape[1])
            t_in = used_inputs(record, prep, b.teacher_inputs[0], completion=done)
            t1 = time.perf_counter()
            with torch.no_grad():
                outs = teacher_forward(teacher, t_in["input_ids"], t_in["attention_mask"],
                                       spec=spec, columns=None, chunk=128,
                                       used_BU=t_in["used_mask"])  # fmt: skip
            teacher_s[name] += time.perf_counter() - t1
            mbs[name].append((b, prep, outs))
    losses: dict[str, float] = {}

    def run(name: str, *, first: int | None = None) -> None:
        total = 0.0
        for b, prep, outs in mbs[name][:first]:
            logits = rollout_logits(student, b, chunk=CHUNK)
            out = record.loss(logits, outs, prep, tables=None, vocab_size=s_tok.vocab_size,
                              config=opts)  # fmt: skip
            out.sum.backward()
            student.zero_grad(set_to_none=True)
            total += float(out.sum.detach())
        if first is None:
            losses[name] = total

    # warm-up: one microbatch each, then the two alternate
    wall = alternated_medians(run, ("padded", "packed"), reps=REPS)
    return _render(r, lengths, mbs, wall, teacher_s, losses, sample_s=sample_s)


def _positions(name: str, mbs) -> tuple[int, int]:
    """(positions the student computes, tokens) over a layout's microbatches."""
    positions = sum(
        b.input_ids_BT.numel() if b.packed is None else b.packed.positions for b, _, _ in mbs
    )
    return positions, sum(int(b.attention_mask_BT.sum()) for b, _, _ in mbs)


def _same_microbatches_packed(mbs) -> float:
    """The padding if the padded layout's own microbatches (ROWS rollouts each) were packed,
    as data.packing does at an unchanged onpolicy.micro_batch_size (rows of 2 x longest)."""
    from trainer.onpolicy.packed_rollouts import pack_rollouts

    positions = tokens = 0
    longest = max(int(b.attention_mask_BT.sum(1).max()) for b, _, _ in mbs)
    for b, _, _ in mbs:
        lens = b.attention_mask_BT.sum(1).tolist()
        p = pack_rollouts(b.input_ids_BT, lens, row_tokens=2 * longest, buffer=ROWS, pad_id=2)
        positions, tokens = positions + p.positions, tokens + sum(lens)
    return 1.0 - tokens / positions


def _render(r, lengths, mbs, wall, teacher_s, losses, *, sample_s: float) -> str:
    new = [len(c) for c in r.completions]
    lines = [
        "## Packed vs padded on-policy rollouts (issue 43)",
        "",
        f"{len(r)} rollouts sampled by SmolLM2-135M-Instruct ({sample_s:.0f} s) from the shipped "
        f"example conversations' prompts (its own template), temperature 1, up to {NEW} new "
        f"tokens: {min(new)}-{max(new)} new (mean {statistics.fmean(new):.0f}), "
        f"{sum(r.stopped)} ended at end-of-turn/EOS; rows of {min(lengths)}-{max(lengths)} "
        f"student tokens (prompt + completion). fp32, {THREADS} torch threads. An equal budget "
        f"of {ROWS * max(lengths):,} student positions per microbatch: padded, {ROWS} rollouts "
        "padded to the longest of them (`onpolicy.micro_batch_size` 4); packed, the rollouts "
        f"{PACKED_ROWS} rows of up to {ROWS // PACKED_ROWS * max(lengths)} tokens hold "
        "(`data.packed_tokens`, best-fit over the default buffer), packed as a run packs each "
        "microbatch (`pack_rollouts`). Timed: the student's forward on those rows (chunked "
        "logits laid back per rollout), the alm loss against Gemma-3-270M's outputs (shipped "
        f"`gemma` template, on-the-fly alignment) and the backward, median of {REPS} alternated "
        "passes after a warm-up microbatch each. The teacher scores each microbatch's rollouts "
        "unpacked in both layouts (its seconds apart, once). "
        f"CPU: {cpu_model()}, {os.cpu_count()} cores.",
        "",
        "| layout | microbatches | positions computed | tokens | padding | student s | teacher s | alm sum |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("padded", "packed"):
        positions, tokens = _positions(name, mbs[name])
        lines.append(
            f"| {name} | {len(mbs[name])} | {positions:,} | {tokens:,} | "
            f"{1 - tokens / positions:.1%} | {wall[name]:.1f} | {teacher_s[name]:.1f} | "
            f"{losses[name]:.2f} |"
        )
    pad_p = 1 - _positions("packed", mbs["packed"])[1] / _positions("packed", mbs["packed"])[0]
    ratio = wall["padded"] / wall["packed"]
    step = (wall["padded"] + teacher_s["padded"]) / (wall["packed"] + teacher_s["packed"])
    lines += [
        "",
        f"Packed: the student's part {ratio:.2f}x faster than padded over the same rollouts "
        f"(goal >= 1.35x: {'met' if ratio >= 1.35 else 'not met'}), {step:.2f}x with the "
        f"teacher's scoring added; padding {pad_p:.1%} of the positions the student computes "
        f"(goal <= 5%: {'met' if pad_p <= 0.05 else 'not met'}). Packing the padded layout's "
        f"own microbatches ({ROWS} rollouts each, the same `onpolicy.micro_batch_size`) leaves "
        f"{_same_microbatches_packed(mbs['padded']):.1%} padding. The alm sums agree (the same "
        "terms, each within its own rollout).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
