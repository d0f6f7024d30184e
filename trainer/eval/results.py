"""Results as JSON and as one Markdown table: a column per model and the paired differences.

The table has a row per (task, metric) for the metrics the field quotes (acc, acc_norm and the
gold answer's bits per byte for multiple choice; acc and bpb for LAMBADA; bpb for gold-answer and
text tasks; exact match / pass@1 for generation), each "value ± standard error". With several
models, each model after the first gets a "Δ vs first" column: the paired difference over the
examples both scored, with its paired standard error. The JSON holds everything, per-example
samples included, so a later run can be compared with this one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tokenbridge import atomic
from trainer.eval.estimates import METRICS, SHOWN, paired_diff

LOWER_IS_BETTER = {"bpb", "bits_per_token"}


def _fmt(value: float, se: float, *, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "—"
    v = f"{value:+.3f}" if signed else f"{value:.3f}"
    return v if se is None or math.isnan(se) else f"{v} ± {se:.3f}"


def model_names(model_dirs: list[str]) -> list[str]:
    """Column (and run report legend) names: the shortest path suffixes that tell them apart
    (`runs/demo/export`, `runs/demo-ce/export` -> `demo/export`, `demo-ce/export`)."""
    parts = [Path(d).resolve().parts[1:] or (str(d),) for d in model_dirs]
    for k in range(1, max((len(p) for p in parts), default=1) + 1):
        names = ["/".join(p[-k:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [f"{p[-1]}#{i}" for i, p in enumerate(parts)]  # the same directory twice


def table_rows(payload: dict) -> list[dict]:
    """One dict per (task, metric): values per model and differences against the first."""
    names = list(payload["models"])
    first = payload["models"][names[0]]["results"] if names else {}
    rows = []
    for task in payload["tasks"]:
        res = {n: payload["models"][n]["results"].get(task) for n in names}
        some = next((r for r in res.values() if r), None)
        if some is None:
            continue
        for metric in SHOWN[some["kind"]]:
            spec = METRICS[some["kind"]][metric]
            row = {
                "task": task,
                "metric": metric,
                "primary": metric == some["primary"],
                "n": some["n"],
                "values": {},
                "diffs": {},
            }
            for n in names:
                m = res[n]["metrics"][metric] if res[n] else None
                row["values"][n] = (m["value"], m["stderr"]) if m else (math.nan, math.nan)
            for n in names[1:]:
                if res[n] and task in first:
                    d, se, _ = paired_diff(spec, first[task]["samples"], res[n]["samples"])
                    row["diffs"][n] = (d, se)
            rows.append(row)
    return rows


def table_cells(payload: dict) -> tuple[list[str], list[list[str]]]:
    """The side-by-side table as text cells (header, rows): the Markdown table and the HTML
    page beside the chart (`trainer.eval.chart`) show the same cells."""
    names = list(payload["models"])
    head = ["task", "metric", "n", *names, *(f"Δ {n} − {names[0]}" for n in names[1:])]
    rows = []
    for row in table_rows(payload):
        metric = row["metric"] + ("*" if row["primary"] else "")
        metric += " ↓" if row["metric"] in LOWER_IS_BETTER else ""
        cells = [row["task"], metric, str(row["n"])]
        cells += [_fmt(*row["values"][n]) for n in names]
        cells += [_fmt(*row["diffs"].get(n, (math.nan, math.nan)), signed=True) for n in names[1:]]
        rows.append(cells)
    return head, rows


def markdown_table(payload: dict) -> str:
    head, rows = table_cells(payload)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    limit = payload.get("options", {}).get("limit")
    lines.append("")
    lines.append(
        "`*` the task's primary metric (as OLMES reports it); `↓` lower is better; ± one "
        "standard error; Δ paired over the same examples. "
        + (f"LIMIT={limit} examples per task (a stable subset)." if limit else "Full sets.")
    )
    notes = _notes(payload)
    if notes:
        lines.append("")
        lines.append("Counted, not hidden: " + "; ".join(notes) + ".")
    return "\n".join(lines) + "\n"


def _notes(payload: dict) -> list[str]:
    notes = []
    for name, info in payload["models"].items():
        for task, res in info["results"].items():
            for key, count in res.get("counts", {}).items():
                if count and key != "windows":
                    notes.append(f"{name} {task}: {count} {key.replace('_', ' ')}")
    return notes


def timing_table(payload: dict) -> str:
    """Wall and CPU seconds (all threads) per task and model."""
    names = list(payload["models"])
    head = "| task | " + " | ".join(f"{n} wall s | {n} CPU s" for n in names) + " |"
    lines = [head, "|" + "---|" * (2 * len(names) + 1)]
    for task in payload["tasks"]:
        cells = []
        for n in names:
            res = payload["models"][n]["results"].get(task, {})
            cells += [
                f"{res.get('seconds', math.nan):.1f}",
                f"{res.get('cpu_seconds', math.nan):.1f}",
            ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    cells = []
    for n in names:
        res = payload["models"][n]["results"].values()
        cells += [f"{sum(r.get('seconds', 0) for r in res):.1f}"]
        cells += [f"{sum(r.get('cpu_seconds', math.nan) for r in res):.1f}"]
    lines.append("| **all tasks** | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write beside, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write(path, data, fsync=False, tmp=path.with_name(path.name + ".tmp"))


def write_results(payload: dict, out: Path) -> tuple[Path, Path]:
    """``out`` (JSON) and the Markdown table beside it (same name, .md)."""
    out = Path(out)
    write_atomic(out, json.dumps(payload, indent=1, default=float) + "\n")
    md = out.with_suffix(".md")
    write_atomic(md, markdown_table(payload) + "\n" + timing_table(payload))
    return out, md
