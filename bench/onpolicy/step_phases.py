"""Part 3 of `bench.onpolicy.section`: the on-policy step with the demo models, each phase
(generate, align, teacher score, student step) timed alone, and its Markdown.
"""

from __future__ import annotations

import statistics
import time

import torch

from tokenbridge import paths

ROWS, PROMPT, NEW = 4, 16, 48


def _median(fn, reps: int = 2):
    out = fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def step_breakdown() -> dict:
    from bench.common import ensure_projection
    from bench.onpolicy.prompt_texts import prompts_from_kjv
    from tokenbridge import models
    from tokenbridge.losses.modes import MODES
    from tokenbridge.losses.xtoken import XTokenConfig
    from tokenbridge.projection import load_projection
    from tokenbridge.teacher.forward import teacher_forward
    from tokenbridge.tokenizers import load_tokenizer
    from trainer.config.schema import ModelConfig
    from trainer.loss_terms import used_inputs
    from trainer.onpolicy.realign import TeacherView
    from trainer.onpolicy.rollout_scoring import scoring_spec
    from trainer.onpolicy.rollouts import build_batch, completion_rows
    from trainer.onpolicy.sampling.sampler import SamplingConfig, sample

    torch.set_num_threads(1)
    s_tok, t_tok = load_tokenizer(paths.student_dir()), load_tokenizer(paths.teacher_dir())
    student = models.build_model(ModelConfig(str(paths.student_dir())))
    teacher = models.freeze(models.build_model(ModelConfig(str(paths.teacher_dir()))))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-6)
    record, opts = MODES["xtoken"], XTokenConfig(k=32)
    # conf=demo's projection: built here on a fresh clone (`make bench` runs no `make demo`)
    tables = record.tables(load_projection(ensure_projection()), teacher_vocab_size=t_tok.vocab_size,
                           student_vocab_size=s_tok.vocab_size)  # fmt: skip
    spec = scoring_spec(record.teacher_spec(opts, tables, teacher_vocab_size=t_tok.vocab_size))
    view = TeacherView(t_tok, 512, stop_id=t_tok.eos_id)
    prompts = prompts_from_kjv(s_tok, ROWS, PROMPT)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=NEW)

    def generate():
        student.eval()
        try:
            return sample(student, prompts, config=cfg, seeds=list(range(ROWS)), stop_ids=[],
                          vocab_size=s_tok.vocab_size)  # fmt: skip
        finally:
            student.train()

    gen_s, r = _median(generate)
    align_s, b = _median(lambda: build_batch(r, list(range(ROWS)), student=s_tok,
                                             teachers=[view], want_cols=[False], pad_id=0))  # fmt: skip
    prep = record.prepare(b.aligned[0], b.targets_BT)
    # as the trainer's worker: the positions the loss and the eval read
    done = completion_rows(b.aligned[0], b.teacher_inputs[0]["input_ids"].shape[1])
    inp = used_inputs(record, prep, b.teacher_inputs[0], completion=done)

    def score():
        with torch.no_grad():
            return teacher_forward(teacher, inp["input_ids"], inp["attention_mask"], spec=spec,
                                   columns=None, chunk=128,
                                   used_BU=inp["used_mask"])  # fmt: skip

    score_s, outs = _median(score)

    def learn():
        logits = student(input_ids=b.input_ids_BT, attention_mask=b.attention_mask_BT).logits
        out = record.loss(logits, outs, prep, tables=tables, vocab_size=s_tok.vocab_size,
                          config=opts)  # fmt: skip
        out.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int(out.count)

    learn_s, terms = _median(learn)
    return {
        "rows": ROWS, "prompt": PROMPT, "new": NEW, "student_tokens": int(b.attention_mask_BT.sum()),
        "teacher_tokens": int(inp["attention_mask"].sum()), "chunks": terms,
        "teacher_scored": int(inp["used_mask"].sum()),
        "generate_s": gen_s, "align_s": align_s, "score_s": score_s, "learn_s": learn_s,
        "dropped": sum(b.drops[0].values()),
    }  # fmt: skip


def render_step(s: dict) -> list[str]:
    base = s["generate_s"] + s["learn_s"]
    over = (s["align_s"] + s["score_s"]) / base
    rows = [
        ("generate (student samples, KV cache)", s["generate_s"]),
        ("align (decode, teacher tokenizer, aligner)", s["align_s"]),
        ("teacher score (Gemma forward + xtoken outputs)", s["score_s"]),
        ("student forward + xtoken + backward + AdamW", s["learn_s"]),
    ]
    lines = [
        f"**The on-policy step, demo models**: SmolLM2-135M samples {s['rows']} x {s['new']} "
        f"tokens after {s['prompt']}-token KJV prompts ({s['student_tokens']} student / "
        f"{s['teacher_tokens']} teacher tokens, {s['teacher_scored']} of them scored "
        f"(the positions the loss reads), {s['chunks']} completion chunks, "
        f"{s['dropped']} rollouts dropped); Gemma-3-270M scores through on-the-fly alignment. "
        "Each phase alone, one thread, median of 2.",
        "",
        "| phase | seconds | share of generate + student step |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {v:.2f} | {v / base:.0%} |" for name, v in rows]
    lines += [
        "",
        f"Overhead of scoring + alignment over generation + student step: **{over:.0%}** "
        "(goal <= 25%). In a run the teacher scores in its worker process, overlapping the "
        "student (`onpolicy.lag: 1` overlaps it with the student's step as well).",
        "",
    ]
    return lines
