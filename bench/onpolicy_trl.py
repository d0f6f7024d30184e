"""TRL 1.16's GOLDTrainer on-policy step next to ours (run by bench/bench_onpolicy.py, own process).

``python bench/onpolicy_trl.py OUT.json``. Same student (SmolLM2-135M), same conversations (a
KJV verse's first words as the user turn), same batch, the same number of new tokens, one torch
thread; the teacher is one TRL's cross-tokenizer path accepts: byte-level, a tiny random Llama
with the GPT-2 fixture vocabulary (llama.cpp's ggml-vocab-gpt-2.gguf, converted to an HF
tokenizer). TRL: ``lmbda=1`` (every step on-policy: the student generates with ``generate``),
``use_uld_loss=True`` (its cross-tokenizer loss), gradient checkpointing off (as ours),
``trainer.train()`` for a few steps, each step timed by a callback. Ours: the same rollout size through `trainer.onpolicy` (sampler, on-the-fly
alignment, the teacher's scoring forward, `alm` over completion chunks, backward, AdamW).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from tokenbridge import paths

B, NEW, STEPS = 4, 32, 3


def teacher_dir(tmp: Path) -> Path:
    """A tiny random Llama with the GPT-2 fixture vocabulary, saved with its tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = paths.vocab_fixture("gpt-2")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = tmp / "gpt2-tiny"
    tok.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def conversations(n: int) -> list[list[dict]]:
    lines = (paths.corpus_dir() / "kjv.jsonl").read_text().splitlines()
    out = []
    for line in lines[::97][:n]:
        words = json.loads(line)["text"].split()
        out.append([{"role": "user", "content": " ".join(words[:6])},
                    {"role": "assistant", "content": " ".join(words[6:])}])  # fmt: skip
    return out


def trl_steps(tmp: Path, t_dir: Path, convs) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gold import GOLDConfig, GOLDTrainer

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    student = AutoModelForCausalLM.from_pretrained(paths.student_dir())
    teacher = AutoModelForCausalLM.from_pretrained(t_dir)
    tok = AutoTokenizer.from_pretrained(paths.student_dir())
    args = GOLDConfig(
        output_dir=str(tmp / "trl"), per_device_train_batch_size=B, max_steps=STEPS, lmbda=1.0,
        use_uld_loss=True, teacher_tokenizer_name_or_path=str(t_dir),
        max_completion_length=NEW, temperature=1.0, learning_rate=1e-5, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, dataloader_num_workers=0, seed=0,
        gradient_checkpointing=False,  # like ours: no recomputation in backward
    )  # fmt: skip
    ds = Dataset.from_list([{"messages": c} for c in convs])
    trainer = GOLDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Timer()])  # fmt: skip
    trainer.train()
    return times


def our_steps(t_dir: Path, convs) -> dict:
    from tokenbridge import models
    from tokenbridge.chat.align import prepare_side
    from tokenbridge.chat.encode import encode_renderings
    from tokenbridge.chat.templates import named_template, resolve_template
    from tokenbridge.losses.alm import AlmConfig
    from tokenbridge.losses.modes import MODES
    from tokenbridge.teacher.forward import teacher_forward
    from tokenbridge.tokenizers import load_tokenizer
    from trainer.config.schema import ModelConfig
    from trainer.onpolicy.prompts import render_prompt
    from trainer.onpolicy.realign import TeacherView
    from trainer.onpolicy.rollout_scoring import scoring_spec
    from trainer.onpolicy.rollouts import build_batch
    from trainer.onpolicy.sampler import SamplingConfig, sample

    s_tok, t_tok = load_tokenizer(paths.student_dir()), load_tokenizer(t_dir)
    s_side = prepare_side(s_tok, resolve_template(paths.student_dir()))
    t_side = prepare_side(t_tok, named_template("chatml"))
    msgs = [tuple(c[:1]) for c in convs]
    prompts = [encode_renderings(s_tok, s_side.matcher, [render_prompt(s_side, list(m))]).ids
               .tolist() for m in msgs]  # fmt: skip
    student = models.build_model(ModelConfig(str(paths.student_dir())))
    teacher = models.freeze(models.build_model(ModelConfig(str(t_dir))))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5)
    record, opts = MODES["alm"], AlmConfig()
    spec = scoring_spec(record.teacher_spec(opts, None, teacher_vocab_size=t_tok.vocab_size))
    from trainer.onpolicy.teachers import stop_for

    view = TeacherView(t_tok, 1024, t_side, stop_for(t_tok, t_side))
    stops = [s_tok.eos_id, *map(int, s_side.markers.close_ids)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=NEW)
    steps = []
    for i in range(STEPS + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        student.eval()
        r = sample(student, prompts, config=cfg, seeds=[i * B + j for j in range(B)],
                   stop_ids=stops, vocab_size=s_tok.vocab_size)  # fmt: skip
        student.train()
        r.meta = [{"messages": m} for m in msgs]
        b = build_batch(r, list(range(B)), student=s_tok, teachers=[view], want_cols=[False],
                        pad_id=0)  # fmt: skip
        inp = b.teacher_inputs[0]
        with torch.no_grad():
            outs = teacher_forward(teacher, inp["input_ids"], inp["attention_mask"], spec=spec,
                                 columns=None, chunk=128)  # fmt: skip
        logits = student(input_ids=b.input_ids_BT, attention_mask=b.attention_mask_BT).logits
        prep = record.prepare(b.aligned[0], b.targets_BT)
        out = record.loss(logits, outs, prep, tables=None, vocab_size=s_tok.vocab_size,
                          config=opts)  # fmt: skip
        out.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - t0)
    return {"steps": steps[1:], "new_tokens": r.new_tokens, "dropped": sum(b.drops[0].values())}


def main(out: str) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t_dir = teacher_dir(tmp)
        convs = conversations(B * STEPS)
        ours = our_steps(t_dir, convs[:B])
        try:
            theirs = trl_steps(tmp, t_dir, convs)
            error = None
        except Exception as e:  # reported in BENCHMARKS.md, with why
            theirs, error = [], f"{type(e).__name__}: {str(e)[:300]}"
    res = {
        "batch": B, "new_tokens": NEW, "ours_steps": ours["steps"], "ours_new": ours["new_tokens"],
        "ours_dropped": ours["dropped"], "trl_steps": theirs, "trl_error": error,
        "ours_median": statistics.median(ours["steps"]),
        "trl_median": statistics.median(theirs[1:] or theirs) if theirs else None,
    }  # fmt: skip
    Path(out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
