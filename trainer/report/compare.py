"""`python -m trainer.report.compare RUN_DIR [RUN_DIR ...]`: runs side by side, in one table.

The student before training, each run's student after, the teacher, and the share of the
student -> teacher gap each run closed, on the same held-out bits per byte (the runs must share
their eval set; a mismatch is refused): gap closed = (student before - run after) / (student
before - teacher). Above 100%: the run beat the teacher. Reads each run's summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenbridge import cli, urls
from tokenbridge.cli import UsageError


def load_summary(run_dir: Path) -> dict:
    """A finished run's summary.json, or a one-line error naming the folder."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise UsageError(f"{run_dir}: no summary.json (not a finished run folder)")
    return json.loads(path.read_text())


def gap_closed(before: float, after: float, teacher: float) -> float | None:
    """Share of the student -> teacher gap a run closed; None when the teacher does not lead."""
    gap = before - teacher
    return None if gap <= 0 else (before - after) / gap


def _same_eval(summaries: dict[str, dict]) -> None:
    keys = {n: (s.get("eval_texts"), s.get("eval_bytes")) for n, s in summaries.items()}
    if len(set(keys.values())) > 1:
        raise UsageError(f"the runs were evaluated on different held-out texts: {keys}")
    befores = {n: round(s["bpb"]["student_before"], 6) for n, s in summaries.items()}
    if len(set(befores.values())) > 1:
        raise UsageError(f"the runs start from different students (bits/byte before): {befores}")


def render(summaries: dict[str, dict]) -> str:
    """The Markdown table of `summaries` (run label -> summary.json)."""
    _same_eval(summaries)
    first = next(iter(summaries.values()))
    before = first["bpb"]["student_before"]
    teachers = {}
    for s in summaries.values():
        teachers.update(s["bpb"].get("teachers") or {})
    teacher = min(teachers.values()) if teachers else None
    lines = [
        f"Held-out bits per byte ({first['eval_texts']} windows of held-out documents, "
        f"{first['eval_bytes']:,} bytes; lower is better)",
        "",
        "| run | steps | train s | bits/byte after | change | gap to teacher closed |",
        "|---|---:|---:|---:|---:|---:|",
        f"| student before training | 0 | - | {before:.4f} | - | - |",
    ]
    for label, s in summaries.items():
        after = s["bpb"]["student_after"]
        closed = None if teacher is None else gap_closed(before, after, teacher)
        lines.append(
            f"| {label} | {s['steps_this_run']} | {s['train_seconds']:.0f} | {after:.4f} | "
            f"{after - before:+.4f} | {'-' if closed is None else f'{100 * closed:.0f}%'} |"
        )
    for name, bpb in teachers.items():
        lines.append(f"| teacher {name} (untrained reference) | - | - | {bpb:.4f} | - | - |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv, prog="report.compare")


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.report.compare", description=__doc__)
    ap.add_argument("runs", nargs="+", help="run folders, each optionally LABEL=DIR")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    out = urls.check(args.out, where="--out", doing="writing the table to")
    summaries = {}
    for spec in args.runs:
        label, _, path = spec.rpartition("=")
        path = urls.local(urls.check(path, where="run folder", doing="reading"))
        summaries[label or path.name] = load_summary(path)
    text = render(summaries)
    if out:
        urls.local(out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
