"""Part 4 of `bench.onpolicy.section` (issue 29): TRL's GOLDTrainer on-policy step next to ours, as
a user would compare them.

The same pair, chat prompts, batch and cores; TRL runs its own code with one change, its
ByteLevel gate lifted for Gemma. Each run is its own process tree, its peak read as PSS and as
a sum of RSS (`bench.child.run_measured`).

    python -m bench.onpolicy.vs_trl [--new 64,128] [--steps 5]     # prints JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.child import run_measured
from tokenbridge import paths

BATCH, THREADS, CONTENT_CHARS = 2, 2, 400


def write_conversations(path: Path, n: int) -> Path:
    """`n` conversations as `messages` JSONL: a user turn (a verse's first words, at most
    `CONTENT_CHARS` characters) and an assistant turn (the rest): only the user turn prompts."""
    lines = (paths.corpus_dir() / "kjv.jsonl").read_text().splitlines()
    with path.open("w") as f:
        for line in lines[::97][:n]:
            words = json.loads(line)["text"].split()
            user = " ".join(words[:8])[:CONTENT_CHARS]
            msgs = [{"role": "user", "content": user},
                    {"role": "assistant", "content": " ".join(words[8:])}]  # fmt: skip
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def trl_child(conversations: str, new: int, steps: int, out: str) -> None:
    """TRL's GOLDTrainer for `steps` steps (run as its own process: ``trl`` subcommand)."""
    import torch
    import trl.experimental.utils as trl_utils
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gold import GOLDConfig, GOLDTrainer

    torch.set_num_threads(THREADS)
    # the gate, lifted: Gemma's pieces are not ByteLevel; their byte offsets then come from
    # the fast tokenizer's character offsets, which are exact
    trl_utils.is_byte_level_tokenizer = lambda backend: True
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    rows = [json.loads(x) for x in Path(conversations).read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        args = GOLDConfig(
            output_dir=tmp, per_device_train_batch_size=BATCH, max_steps=steps, lmbda=1.0,
            use_uld_loss=True, teacher_tokenizer_name_or_path=str(paths.teacher_dir()),
            max_completion_length=new, temperature=1.0, top_p=1.0, learning_rate=2e-5,
            report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
            dataloader_num_workers=0, seed=0, gradient_checkpointing=False,
        )  # fmt: skip
        trainer = GOLDTrainer(
            model=AutoModelForCausalLM.from_pretrained(paths.student_dir()),
            teacher_model=AutoModelForCausalLM.from_pretrained(paths.teacher_dir()),
            args=args, train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(paths.student_dir()),
            callbacks=[Timer()],
        )  # fmt: skip
        trainer.train()
    Path(out).write_text(json.dumps({"steps": times}))


def _shards(tmp: Path) -> Path:
    """A small shard directory: conf=onpolicy_demo names one (no off-policy step reads it)."""
    data = tmp / "data"
    data.mkdir()
    lines = (paths.corpus_dir() / "kjv.jsonl").read_text().splitlines()[:200]
    (data / "kjv.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp / "shards"
    run_measured([sys.executable, "-m", "pipelines.align", "--data", str(data / "kjv.jsonl"),
                  "--teacher", str(paths.teacher_dir()), "--student", str(paths.student_dir()),
                  "--out", str(out), "--max-student-tokens", "128", "--max-teacher-tokens",
                  "128", "--direct_num_workers", "1"])  # fmt: skip
    return out


def ours(
    tmp: Path, shards: Path, conversations: Path, *, new: int, lag: int, steps: int,
    placement: str = "worker", weights: str = "model", threads: int = 0,
) -> dict:  # fmt: skip
    run = tmp / f"ours_{new}_{lag}_{placement}_{weights}"
    args = [sys.executable, "trainer/main.py", "conf=onpolicy_demo", f"run_dir={run}",
            f"data.shards={shards}", f"steps={steps}", "optim.warmup_steps=1",
            "onpolicy.prompts=chat", f"onpolicy.chat_data={conversations}",
            f"onpolicy.prompts_per_step={BATCH}", f"onpolicy.max_new_tokens={new}",
            f"onpolicy.lag={lag}", "onpolicy.loss=xtoken", "onpolicy.top_p=1.0",
            "onpolicy.teacher_chat_templates=[gemma]",  # the GGUF-made dir has none
            "onpolicy.eval_prompts=0", "eval.max_texts=0", f"parallel.threads={threads}",
            "checkpoint.save_at_end=false", "checkpoint.export_at_end=false",
            "logging.progress=false", "logging.tensorboard=false", "device=cpu",
            f"parallel.teacher_placement={placement}",
            f"onpolicy.sampler_weights={weights}"]  # fmt: skip
    peaks: dict = {}
    _, wall, peak = run_measured(args, peaks=peaks)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["step_s"] for r in rows if r["kind"] == "train"]
    return {"steps": step_s, "median_s": steady(step_s), "peak_gib": peak,
            "pss_gib": peaks["pss_gib"], "wall_s": wall}  # fmt: skip


def steady(step_s: list[float]) -> float:
    """The median step between the first and the last: the first warms up (and at lag 1 samples
    two rollouts); after the last, lag 1 samples none."""
    if len(step_s) < 3:
        raise ValueError(f"{len(step_s)} steps: the steady median needs 3 or more")
    return statistics.median(step_s[1:-1])


def trl(tmp: Path, conversations: Path, *, new: int, steps: int) -> dict:
    out = tmp / f"trl_{new}.json"
    peaks: dict = {}
    _, wall, peak = run_measured(
        [sys.executable, "-m", "bench.onpolicy.vs_trl", "trl", str(conversations), str(new),
         str(steps), str(out)],
        env={"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}, peaks=peaks,
    )  # fmt: skip
    times = json.loads(out.read_text())["steps"]
    return {"steps": times, "median_s": steady(times), "peak_gib": peak,
            "pss_gib": peaks["pss_gib"], "wall_s": wall}  # fmt: skip


def measure(new_tokens: list[int], steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="onpolicy_vs_trl_") as d:
        tmp = Path(d)
        conv = write_conversations(tmp / "conversations.jsonl", BATCH * (steps + 2) * 4)
        shards = _shards(tmp)
        out = {}
        for new in new_tokens:
            out[str(new)] = {
                "trl": trl(tmp, conv, new=new, steps=steps),
                "ours_lag0": ours(tmp, shards, conv, new=new, lag=0, steps=steps),
                "ours_lag1": ours(tmp, shards, conv, new=new, lag=1, steps=steps),
                # one process, one torch: the memory of TRL's layout (no overlap: lag 0)
                "ours_lag0_inprocess": ours(
                    tmp, shards, conv, new=new, lag=0, steps=steps, placement="inprocess"
                ),  # fmt: skip
                # sampling from the int8 copy, ratio-weighted (docs/onpolicy.md)
                "ours_lag0_int8": ours(
                    tmp, shards, conv, new=new, lag=0, steps=steps, weights="int8"
                ),  # fmt: skip
                "ours_lag1_int8": ours(
                    tmp, shards, conv, new=new, lag=1, steps=steps, weights="int8"
                ),  # fmt: skip
            }
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trl"]:
        trl_child(argv[1], int(argv[2]), int(argv[3]), argv[4])
        return
    ap = argparse.ArgumentParser(prog="python -m bench.onpolicy.vs_trl")
    ap.add_argument("--new", default="64,128", help="new tokens per rollout (comma list)")
    ap.add_argument(
        "--steps", type=int, default=5, help="steps per run (the first and the last not counted)"
    )
    args = ap.parse_args(argv)
    print(json.dumps(measure([int(x) for x in args.new.split(",")], args.steps), indent=2))


if __name__ == "__main__":
    main()


# the table's columns: TRL first, then our layouts
VARIANTS = (
    ("trl", "TRL"),
    ("ours_lag0", "ours lag 0"),
    ("ours_lag1", "ours lag 1"),
    ("ours_lag0_inprocess", "ours lag 0, teacher in process"),
    ("ours_lag0_int8", "ours lag 0, int8 sampling"),
    ("ours_lag1_int8", "ours lag 1, int8 sampling"),
)


def render(res: dict) -> list[str]:
    """Issue 29's table from `measure`'s result (goals: >= 2.5x faster, peak <= TRL's)."""
    lines = [
        f"**TRL GOLDTrainer vs ours, the real pair** (`bench/onpolicy/vs_trl.py`): SmolLM2-135M "
        f"samples chat prompts (KJV conversations' first user turns), Gemma-3-270M scores them "
        f"(TRL: ULD over its byte-offset groups, its ByteLevel gate lifted; ours: xtoken over "
        f"on-the-fly aligned chunks), batch {BATCH}, temperature 1, top-p 1, AdamW, "
        f"{THREADS} cores (TRL at {THREADS} torch threads, ours with the trainer's thread plan: "
        f"{THREADS} threads, and at lag 1 one each for the sampler and the teacher worker while "
        "both compute), one after the other; median of the steps between the first "
        f"and the last (the first warms up; at lag 1 it samples twice, and after the last it "
        f"samples nothing), and the "
        "peak memory of each process tree (ours: trainer + teacher worker) as PSS (a page "
        "two processes share counted once: the physical memory) and as a sum of RSS (shared "
        "pages, such as torch's libraries, counted in each process).",
        "",
        "| new tokens | "
        + " | ".join(f"{label} s" for _, label in VARIANTS)
        + " | TRL / ours (fastest) | peak PSS GiB (same order) | peak RSS sum GiB (same order) |",
        "|---:|" + "---:|" * (len(VARIANTS) + 3),
    ]
    for new, r in res.items():
        runs = [r[k] for k, _ in VARIANTS if k in r]
        best = min(x["median_s"] for x in runs[1:])
        lines.append(
            f"| {new} | "
            + " | ".join(f"{x['median_s']:.2f}" for x in runs)
            + f" | **{runs[0]['median_s'] / best:.2f}x** | "
            + " / ".join(f"{x['pss_gib']:.2f}" for x in runs)
            + " | "
            + " / ".join(f"{x['peak_gib']:.2f}" for x in runs)
            + " |"
        )
    lines += ["", "Goals: our step >= 2.5x faster than TRL's at both lengths, our peak <= TRL's, "
              "lag 1 faster than lag 0.", ""]  # fmt: skip
    return lines
