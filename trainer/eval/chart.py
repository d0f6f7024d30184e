"""The eval suite's side-by-side results as a picture: each task's primary metric per model.

One panel per task, a bar per model (the same colour in every panel) with its standard-error
bar, written beside the results JSON and Markdown table as ``<out>.png`` and ``<out>.html`` (the
chart and the full table, self-contained). Rows come from `trainer.eval.results.table_rows`, so
the picture and the table cannot disagree. matplotlib is imported only when drawing.
"""

from __future__ import annotations

import math
from pathlib import Path

from trainer.eval.results import LOWER_IS_BETTER, table_cells, table_rows, write_atomic
from trainer.report import html

COLUMNS = 3
PANEL_W_IN, PANEL_H_IN, DPI = 3.7, 2.5, 110  # three panels across a ~1220 px page


def _task_label(task: str) -> str:
    """`text:/long/path/held_out.txt` -> `text:held_out.txt` (titles stay one line)."""
    return "text:" + Path(task[len("text:") :]).name if task.startswith("text:") else task


def primary_rows(payload: dict) -> list[dict]:
    """The primary metric's row of each task (value and standard error per model)."""
    return [r for r in table_rows(payload) if r["primary"]]


def bars(payload: dict) -> list[dict]:
    """What each panel draws, as plain data: the task's title, then per model (in column order)
    the bar's height and its error bar. A model without the task (NaN) gets an empty bar with
    a "—" label instead of one at zero that would read as a score."""
    names = list(payload["models"])
    out = []
    for row in primary_rows(payload):
        arrow = " ↓" if row["metric"] in LOWER_IS_BETTER else " ↑"
        out.append(
            {
                "title": f"{_task_label(row['task'])}: {row['metric']}{arrow}  (n={row['n']})",
                "values": [row["values"][n][0] for n in names],
                "errors": [row["values"][n][1] for n in names],
            }
        )
    return out


def render_chart(payload: dict) -> bytes:
    """A grid of per-task bar charts as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from trainer.report.plots import to_png

    rows = bars(payload)
    names = list(payload["models"])
    ncols = max(1, min(COLUMNS, len(rows)))
    nrows = max(1, math.ceil(len(rows) / ncols))
    fig = Figure(
        figsize=(PANEL_W_IN * ncols, PANEL_H_IN * nrows + 0.5), dpi=DPI, layout="constrained"
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, row in zip(axes, rows):
        values, errors = row["values"], row["errors"]
        xs = list(range(len(names)))
        heights = [0.0 if math.isnan(v) else v for v in values]
        errs = [0.0 if math.isnan(e) else e for e in errors]
        ax.bar(
            xs,
            heights,
            yerr=errs,
            capsize=4,
            color=[f"C{i % 10}" for i in xs],
            error_kw={"elinewidth": 1, "ecolor": "0.2"},
            label=names,
        )
        for x, v, e in zip(xs, values, errs):
            text = "—" if math.isnan(v) else f"{v:.3f}"
            ax.annotate(
                text,
                (x, 0 if math.isnan(v) else v + e),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_title(row["title"], fontsize=9, loc="left")
        ax.set_xticks(xs, [""] * len(xs))
        ax.tick_params(labelsize=7, length=0)
        top = max((h + e for h, e in zip(heights, errs)), default=0.0)
        if min(heights, default=0.0) >= 0:  # bars start at zero; room above for the labels
            ax.set_ylim(0, top * 1.18 if top > 0 else 1.0)
        ax.grid(True, axis="y", alpha=0.25, linewidth=0.6)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    for ax in axes[len(rows) :]:
        ax.set_visible(False)
    handles = [axes[0].patches[i] for i in range(len(names))] if rows else []
    fig.legend(
        handles,
        names,
        loc="outside upper center",
        ncols=min(len(names), 4),
        fontsize=8,
        frameon=False,
    )
    return to_png(fig)


def results_table(payload: dict) -> str:
    """Every row of the Markdown table, as HTML (the same cells)."""
    head, rows = table_cells(payload)
    return html.table(head, rows, left=2)


def write_eval_report(payload: dict, out: str | Path) -> tuple[Path, Path]:
    """``<out>.png`` (the chart) and ``<out>.html`` (chart + table), beside the results JSON."""
    out = Path(out)
    png = render_chart(payload)
    png_path, html_path = out.with_suffix(".png"), out.with_suffix(".html")
    write_atomic(png_path, png)
    names = list(payload["models"])
    limit = payload.get("options", {}).get("limit")
    body = (
        html.figure(
            png,
            alt="primary metric per task",
            width=1200,
            caption="Each task's primary metric per model; error bars: one standard "
            "error. ↓ lower is better, ↑ higher is better.",
        )
        + "<h2>All metrics</h2>"
        + results_table(payload)
        + '<p class="sub">* the task\'s primary metric; ± one standard error; Δ paired over the '
        + "same examples. "
        + (f"LIMIT={limit} examples per task." if limit else "Full sets.")
        + f" Data: <code>{html.esc(out.name)}</code>.</p>"
    )
    title = "tokenbridge eval: " + " vs ".join(names)
    write_atomic(html_path, html.page(title, body, subtitle=payload.get("created", "")))
    return png_path, html_path
