"""The eval suite's "before" column: the real teacher and student on every task, and the batched
KV-reusing scorer against a naive one-forward-per-answer loop, both in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenbridge import paths
from trainer.eval.loglik import BatchLimits, TokenStats, encode_pair, score_items, text_encoder
from trainer.eval.results import markdown_table, timing_table
from trainer.eval.tasks import TASKS, load

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "trainer/eval",
    "tokenbridge/models.py",
    "tokenbridge/model_spec.py",
    "tokenbridge/tokenizers",
    "bench/training/eval.py",
)


LIMIT = int(os.environ.get("TOKENBRIDGE_EVAL_LIMIT", "20"))  # examples per task: a 2-core CPU
# One torch thread: on a 2-core machine that other jobs keep busy, 2 OpenMP threads ran a matmul
# 3x slower than 1 (each barrier waits for the descheduled thread); CPU seconds = the work.
THREADS = int(os.environ.get("TOKENBRIDGE_EVAL_THREADS", "1"))
HELD_OUT = paths.corpus_dir() / "kjv.jsonl"  # not the demo's training text (Shakespeare)


def _held_out() -> str:
    try:
        return str(HELD_OUT.relative_to(paths.REPO_ROOT))
    except ValueError:
        return str(HELD_OUT)


def _run_cli(out: Path) -> dict:
    models = f"{paths.student_dir()},{paths.teacher_dir()}"
    tasks = f"default,text:{_held_out()}"
    cmd = [sys.executable, "-m", "trainer.eval", "--model", models, "--tasks", tasks]
    cmd += ["--limit", str(LIMIT), "--out", str(out), "--no-progress", "--device", "cpu"]
    cmd += ["--threads", str(THREADS)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=paths.REPO_ROOT)
    return json.loads(out.read_text())


def _naive_logprob(model, context: list[int], cont: list[int]) -> float:
    logits = model(torch.tensor([context + cont])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(logp[len(context) + j - 1, t].item() for j, t in enumerate(cont))


def _scorer_vs_naive(n: int = 4) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths.student_dir())
    model = AutoModelForCausalLM.from_pretrained(paths.student_dir(), dtype=torch.float32).eval()
    enc, stats = text_encoder(tok), TokenStats()
    items = []
    for name in ("hellaswag", "mmlu_5shot"):
        for ex in load(TASKS[name], limit=n):
            items.append(
                encode_pair(
                    enc, ex.contexts[0], list(ex.continuations), max_length=4096, stats=stats
                )
            )
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    score_items(model, items[:1])  # warm-up
    t0 = time.perf_counter()
    fast = score_items(model, items, limits=BatchLimits())
    t_fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        slow = [[_naive_logprob(model, it.context, c) for c in it.continuations] for it in items]
    t_slow = time.perf_counter() - t0
    torch.set_num_threads(threads)
    diff = max(abs(f.logprob - s) for fr, sr in zip(fast, slow) for f, s in zip(fr, sr))
    tokens_naive = sum(len(it.context) + len(c) for it in items for c in it.continuations)
    tokens_fast = sum(len(it.context) + sum(len(c) for c in it.continuations) for it in items)
    return (
        f"Scorer against the naive baseline (SmolLM2, {n} HellaSwag + {n} MMLU 5-shot questions, "
        f"{sum(len(i.continuations) for i in items)} answers): one full forward per (context, "
        f"answer) took {t_slow:.1f} s over {tokens_naive:,} tokens; the batched scorer (each "
        f"context once, KV cache repeated per answer, logits only where scored) {t_fast:.1f} s "
        f"over {tokens_fast:,} tokens: **{t_slow / t_fast:.1f}x faster**, same log-probabilities "
        f"up to float32 rounding (max |difference| {diff:.1e} nats over a sum of tokens; the "
        "unit tests check equality to 1e-9 in float64).\n"
    )


def main() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        payload = _run_cli(Path(tmp) / "eval.json")
        wall = time.perf_counter() - t0
    rss = ", ".join(
        f"{n} {m.get('peak_rss_mib', 0):,.0f} MiB" for n, m in payload["models"].items()
    )
    parts = [
        "## Evaluation suite: teacher and student before distillation\n",
        "The real Gemma-3-270M (teacher) and SmolLM2-135M-Instruct (student), fp32 on this CPU "
        f"with {THREADS} torch thread(s), "
        f"LIMIT={LIMIT} examples per task (a stable subset: the same examples every run), the "
        "held-out text being the KJV verses (`text:artifacts/corpus/kjv.jsonl`). This is the "
        "*before* column of every distillation run. At this LIMIT the standard errors are wide "
        "(±0.1 to ±0.15 on an accuracy): differences smaller than two of them are noise; the "
        "bits-per-byte rows are the tighter signal. Reproduce with `make eval LIMIT="
        f"{LIMIT} TASKS=default,text:{_held_out()}` (no LIMIT: full sets).\n",
        markdown_table(payload),
        f"Seconds per task, wall and CPU (the whole run: {wall:.0f} s wall, both models; peak RSS of the eval process after each model: {rss}):\n",
        timing_table(payload),
        _scorer_vs_naive(),
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    print(main())
