"""Drawing: a `Panel` or `Bars` (trainer.report.panels) -> PNG bytes, with matplotlib's Agg canvas.

matplotlib is imported here only, and this module only when a report is written, so the trainer
never pays for it at start-up. No pyplot: figures are built as objects on an Agg canvas, which
leaves no global figure registry or backend choice behind in the process that drew them (the
trainer's, at the end of a run).
"""

from __future__ import annotations

import io

from trainer.report.panels import Bars, Panel

WIDTH_IN, HEIGHT_IN, DPI = 5.4, 3.3, 110  # ~594 x 363 px: two side by side in the page
SMALL = 8


def _figure(width: float = WIDTH_IN, height: float = HEIGHT_IN):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def to_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _style(ax, title: str, *, xlabel: str = "", ylabel: str = "") -> None:
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel(xlabel, fontsize=SMALL)
    ax.set_ylabel(ylabel, fontsize=SMALL)
    ax.tick_params(labelsize=SMALL)
    ax.grid(True, alpha=0.25, linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def render_panel(panel: Panel) -> bytes:
    """Curves over steps: each line raw (faint when a smoothed line is drawn over it) and its
    EMA; reference levels as horizontal lines across the axes."""
    fig = _figure()
    ax = fig.add_subplot()
    _style(ax, panel.title, xlabel="step", ylabel=panel.ylabel)
    for line in panel.lines:
        if line.level is not None:
            ax.axhline(
                line.level,
                color=line.color,
                linestyle=line.style,
                linewidth=1.4,
                label=f"{line.label} ({line.level:.3f})",
            )
            continue
        marker = "o" if line.marker else None
        if line.smoothed is not None:
            ax.plot(
                line.steps,
                line.values,
                color=line.color,
                linestyle=line.style,
                linewidth=0.8,
                alpha=0.3,
            )
            ax.plot(
                line.steps,
                line.smoothed,
                color=line.color,
                linestyle=line.style,
                linewidth=1.8,
                label=line.label,
            )
        else:
            ax.plot(
                line.steps,
                line.values,
                color=line.color,
                linestyle=line.style,
                linewidth=1.5,
                marker=marker,
                markersize=4,
                label=line.label,
            )
    if panel.logy:
        ax.set_yscale("log")
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    if panel.lines:
        ax.legend(fontsize=7, frameon=False, loc="best")
    return to_png(fig)


def render_bars(bars: Bars) -> bytes:
    """Stacked horizontal bars of each group's category shares, with the share printed on
    each segment wide enough to hold it."""
    height = 1.2 + 0.45 * len(bars.groups)
    fig = _figure(height=max(2.0, height))
    ax = fig.add_subplot()
    _style(ax, bars.title, xlabel="share of chunks")
    labels = [g[0] for g in bars.groups]
    lefts = [0.0] * len(bars.groups)
    for k, cat in enumerate(bars.categories):
        shares = [g[2][k] / max(1, sum(g[2])) for g in bars.groups]
        rects = ax.barh(labels, shares, left=lefts, color=f"C{k}", label=cat, height=0.6)
        for rect, share in zip(rects, shares):
            if share >= 0.06:
                x = rect.get_x() + rect.get_width() / 2
                y = rect.get_y() + rect.get_height() / 2
                ax.text(x, y, f"{share:.0%}", ha="center", va="center", fontsize=7, color="white")
        lefts = [a + b for a, b in zip(lefts, shares)]
    ax.set_xlim(0, 1)
    ax.invert_yaxis()  # first group on top
    # below the axes, where long group labels cannot collide with it
    fig.legend(fontsize=7, frameon=False, ncols=len(bars.categories), loc="outside lower center")
    return to_png(fig)


def render(p: Panel | Bars) -> bytes:
    return render_bars(p) if isinstance(p, Bars) else render_panel(p)
