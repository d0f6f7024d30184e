"""The run report: run folders -> ``report.html`` + one PNG per chart + ``report.json``.

``write_report(["runs/demo", "runs/demo-ce"])`` loads each folder (`trainer.report.runs`),
decides what to plot (`trainer.report.panels`), draws it (`trainer.report.plots`) and writes
a page that opens offline: the PNGs are embedded as data URIs and also written beside it, and
report.json holds every plotted series with the metrics.jsonl key it came from.
`after_run` is the trainer's call at the end of a run: it never raises.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from trainer.eval.results import write_atomic
from trainer.report import html
from trainer.report.panels import Bars, Panel, build_panels, panel_json
from trainer.report.runs import Run, load_runs

HTML_FILE = "report.html"
JSON_FILE = "report.json"
# charts a complete run has; any missing is named on the page ("not recorded")
EXPECTED = {
    "loss": "loss",
    "ce": "cross-entropy",
    "bpb": "held-out bits/byte",
    "lr": "learning rate",
    "grad_norm": "gradient norm",
    "tokens_per_s": "throughput",
    "tokens_per_s_per_device": "per-device throughput",
    "kd": "per-teacher KD (a CE-only run has none)",
    "coverage": "alignment coverage",
    "chunk_kinds": "chunk kinds (shard stats.json)",
    "step_time": "step-time split",
}


def default_out(run_dirs: list[Path], runs: list[Run]) -> Path:
    """<run>/report for one run; <first run>/report-vs-<others> for a comparison."""
    if len(runs) == 1:
        return run_dirs[0] / "report"
    others = "-".join(re.sub(r"[^\w.-]+", "_", r.name) for r in runs[1:])
    return run_dirs[0] / f"report-vs-{others}"


def _color_hex(color: str) -> str:
    from matplotlib.colors import to_hex

    return to_hex(color)


def _bpb_cells(run: Run) -> list[str]:
    s = run.student_bpb()
    before = s.values[0] if s.steps and s.steps[0] == 0 else None
    after = run.bpb.get("student_after")
    delta = f" ({after - before:+.4f})" if after is not None and before is not None else ""
    teachers = ", ".join(f"{t} {v:.4f}" for t, v in run.teacher_bpb().items()) or "—"
    return [
        "—" if before is None else f"{before:.4f}",
        "—" if after is None else f"{after:.4f}{delta}",
        teachers,
    ]


RUN_COLUMNS = ["run", "steps", "tokens", "train s", "BPB before", "BPB after", "teacher BPB"]
RUN_COLUMNS += ["last loss", "last CE", "last KD", "folder"]


def runs_table(runs: list[Run], colors: list[str]) -> str:
    """A row per run: its colour, length, held-out BPB and last logged losses."""
    rows = []
    for run, color in zip(runs, colors):
        steps = run.summary.get("steps")
        if steps is None and "loss" in run.train:
            steps = run.train["loss"].steps[-1]
        last = {k: run.train[k].last() if k in run.train else None for k in ("loss", "ce", "kd")}
        rows.append(
            [
                ("raw", html.swatch(_color_hex(color)) + html.esc(run.name)),
                html.fmt(steps),
                html.fmt(run.summary.get("tokens")),
                html.fmt(run.summary.get("train_seconds")),
                *_bpb_cells(run),
                html.fmt(last["loss"]),
                html.fmt(last["ce"]),
                html.fmt(last["kd"]),
                str(run.path),
            ]
        )
    return html.table(RUN_COLUMNS, rows)


def _at(values, i: int):
    """values[i] of a per-teacher stats list, None when the stats lack it."""
    return values[i] if isinstance(values, list) and i < len(values) else None


def _pct(value) -> str:
    return "—" if value is None else f"{value:.1%}"


SHARD_COLUMNS = ["run", "teacher", "documents", "windows", "student tokens", "teacher tokens"]
SHARD_COLUMNS += ["chunks", "exact chunks", "fallback docs", "dead letters"]


def shards_table(runs: list[Run]) -> str:
    """The shards' stats.json, a row per teacher, once per shard folder."""
    rows, seen = [], set()
    for run in runs:
        st = run.shard_stats
        if not st or run.shards in seen:
            continue
        seen.add(run.shards)
        names = run.summary.get("teachers") or []
        for i, t in enumerate(st.get("teachers", [])):
            tokens = st.get("tokens", {})
            rows.append(
                [
                    run.name,
                    _at(names, i) or t.get("name", f"t{i}"),
                    html.fmt(st.get("documents")),
                    html.fmt(st.get("windows")),
                    html.fmt(tokens.get("student")),
                    html.fmt(_at(tokens.get("teachers"), i)),
                    html.fmt(_at(st.get("chunks"), i)),
                    _pct(_at(st.get("exact_chunk_fraction"), i)),
                    _pct(_at(st.get("fallback_rate"), i)),
                    html.fmt(st.get("dead_letters")),
                ]
            )
    if not rows:
        return ""
    where = ", ".join(sorted({str(r.shards) for r in runs if r.shard_stats}))
    return f'<h2>Aligned shards</h2><p class="sub">{html.esc(where)}</p>' + html.table(
        SHARD_COLUMNS, rows, left=2
    )


DEVICE_COLUMNS = ["run", "device", "student dtype", "teacher dtypes", "fused AdamW"]
DEVICE_COLUMNS += ["tokens/s/device", "TFLOP/s/device", "MFU", "teacher MFU", "peak GiB"]


def _median(run: Run, key: str) -> float | None:
    s = run.train.get(key)
    return statistics.median(s.values) if s is not None and len(s) else None


def device_table(runs: list[Run]) -> str:
    """What each run computed in (summary.json's ``precision``) and how fast each device went:
    medians over the logged steps of metrics.jsonl (`trainer.throughput`), the peak memory's
    largest value. A cell is "—" where nothing was recorded (no MFU on a CPU)."""
    rows = []
    for run in runs:
        p = run.summary.get("precision") or {}
        dtype = "—"
        if p:
            dtype = f"{p['param_dtype']} (master {p['master_dtype']}, reduce {p['reduce_dtype']})"
        teachers = ", ".join(f"{k} {v}" for k, v in p.get("teacher_dtypes", {}).items())
        fused = {True: "yes", False: "no"}.get(p.get("fused_optimizer"), "—")
        mfu = [_pct(_median(run, k)) for k in ("mfu", "teacher_mfu")]
        memory = run.train.get("memory_gib")
        rows.append(
            [
                run.name,
                p.get("device", "—"),
                dtype,
                teachers or "—",
                fused,
                html.fmt(_median(run, "tokens_per_s_per_device")),
                html.fmt(_median(run, "tflops_per_device")),
                *mfu,
                html.fmt(max(memory.values)) if memory is not None and len(memory) else "—",
            ]
        )
    return "<h2>Precision and throughput</h2>" + html.table(DEVICE_COLUMNS, rows, left=5)


def render_page(runs: list[Run], charts: list[tuple[Panel | Bars, bytes, str]]) -> str:
    """The page: a table of the runs, their precision and per-device throughput, the charts two
    per row, the shards, what is missing."""
    colors = [f"C{i % 10}" for i in range(len(runs))]
    body = [runs_table(runs, colors), device_table(runs), "<h2>Training</h2>", '<div class="grid">']
    body += [html.figure(png, alt=p.title, caption=p.caption) for p, png, _ in charts]
    body.append("</div>")
    body.append(shards_table(runs))
    shown = {p.name for p, _, _ in charts}
    notes = [f"not recorded: {what}" for name, what in EXPECTED.items() if name not in shown]
    notes += [f"{r.name}: {n}" for r in runs for n in r.notes]
    if notes:
        body.append('<h2>Notes</h2><ul class="notes">')
        body += [f"<li>{html.esc(n)}</li>" for n in notes]
        body.append("</ul>")
    body.append(
        f'<p class="sub">Each chart is also a PNG beside this page; the plotted numbers are in '
        f"<code>{JSON_FILE}</code>.</p>"
    )
    title = "tokenbridge run report: " + " vs ".join(r.name for r in runs)
    subtitle = " · ".join(str(r.path) for r in runs)
    return html.page(title, "\n".join(body), subtitle=subtitle)


def write_report(run_dirs: list[str | Path], *, out: str | Path | None = None) -> Path:
    """Build the report of one or more run folders; returns the path of report.html."""
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError("write_report: no run folder given")
    runs = load_runs(dirs)
    out_dir = Path(out) if out is not None else default_out(dirs, runs)
    panels = build_panels(runs)
    from trainer.report.plots import render  # matplotlib: only now

    charts = []
    for p in panels:
        png = render(p)
        write_atomic(out_dir / f"{p.name}.png", png)
        charts.append((p, png, f"{p.name}.png"))
    data = {
        "runs": {r.name: {"path": str(r.path), "notes": r.notes} for r in runs},
        "panels": {p.name: panel_json(p) for p in panels},
    }
    write_atomic(out_dir / JSON_FILE, json.dumps(data, indent=1) + "\n")
    path = out_dir / HTML_FILE
    write_atomic(path, render_page(runs, charts))
    return path


def after_run(run_dir: str | Path, *, log=None) -> Path | None:
    """The report of a run that just ended; a failure to plot never fails the run: it is
    logged in one line and None returned."""
    try:
        return write_report([run_dir])
    except Exception as e:  # the run's results are on disk already; the report is extra
        line = (
            f"run report not written ({type(e).__name__}: {e}); "
            f"retry with: python -m trainer.report {run_dir}"
        )
        if log is None:
            print(line, file=sys.stderr, flush=True)
        else:
            log(line)
        return None
