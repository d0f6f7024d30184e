"""On-policy distillation next to off-policy KD and CE-only with the same wall-clock budget.

``make demo-onpolicy-compare``: the on-policy demo, then the same config off-policy with
xtoken and with CE only, each stopped once it has trained as long as the first; one Markdown
table. docs/onpolicy.md ("Evaluation") says what the runs report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = {
    "on-policy (xtoken on the student's rollouts)": [],
    "off-policy KD (xtoken on the shards)": ["onpolicy.lmbda=0", "loss=xtoken"],
    "CE only": ["onpolicy.lmbda=0", "loss=ce"],
}


def run(name: str, args: list[str], out: Path) -> dict:
    """One trainer run under ``out``; its summary.json."""
    run_dir = out / name.split(" ")[0].replace("-", "_").lower()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "trainer" / "main.py"), "conf=onpolicy_demo",
           f"run_dir={run_dir}", *args]  # fmt: skip
    print("==", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return json.loads((run_dir / "summary.json").read_text())


def _values(d: dict | None) -> str:
    if not d:
        return "-"
    return " / ".join(f"{v:.3f}" for v in d.values())


def render(results: dict[str, dict], budget: float) -> str:
    lines = [
        f"## On-policy vs off-policy KD vs CE, same wall-clock budget ({budget:.0f} s of steps)",
        "",
        "| run | steps | train s | held-out BPB before -> after | teacher BPB of the "
        "student's completions before -> after |",
        "|---|---:|---:|---|---|",
    ]
    for name, s in results.items():
        b = s["bpb"]
        nan = float("nan")
        lines.append(
            f"| {name} | {s['steps']} | {s['train_seconds']:.0f} | "
            f"{b.get('student_before', nan):.4f} -> {b.get('student_after', nan):.4f} | "
            f"{_values(b.get('teacher_on_student_before'))} -> "
            f"{_values(b.get('teacher_on_student_after'))} |"
        )
    lines += ["", "Lower is better in both columns. The baselines' LR schedule is set for "
              "`--max-steps` and cut by the budget."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "runs" / "onpolicy_compare"))
    ap.add_argument("--max-steps", type=int, default=400, help="the baselines' step ceiling")
    ap.add_argument("extra", nargs="*", help="overrides for all three runs (key=value)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    budget = None
    for name, args in RUNS.items():
        if budget is None:
            results[name] = run(name, [*args, *a.extra], out)
            budget = max(1.0, float(results[name]["train_seconds"]))
            continue
        more = [f"steps={a.max_steps}", f"time_budget_s={budget}"]
        results[name] = run(name, [*args, *more, *a.extra], out)
    text = render(results, budget or 0.0)
    (out / "compare.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
