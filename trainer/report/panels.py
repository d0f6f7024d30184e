"""What the run report plots, as plain data: one `Panel` per chart, built from loaded `Run`s.

Kept apart from the drawing (`trainer.report.plots`) so the numbers can be checked without
matplotlib, and so ``report.json`` is exactly the data behind the pictures: each line records the
run and the metrics.jsonl key it came from. Every run has one colour in every panel; a run with
several teachers draws them with different line styles.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from trainer.report.runs import Run, Series, finite

# matplotlib's default cycle, by name: the same run gets the same colour in every panel
COLORS = [f"C{i}" for i in range(10)]
TEACHER_STYLES = ["-", "--", ":", "-."]
REFERENCE_STYLES = [":", "-.", (0, (5, 2, 1, 2, 1, 2)), (0, (1, 3))]  # never solid: not a run
REFERENCE_COLOR = "0.35"  # a grey for reference levels every run shares


@dataclass
class Line:
    """One curve, or a horizontal reference level (`level` set, no steps)."""

    label: str
    color: str
    steps: list[int]
    values: list[float]
    run: str = ""
    key: str = ""  # metrics.jsonl key (or bpb.json field) the values came from
    style: str | tuple = "-"  # a matplotlib line style
    smoothed: list[float] | None = None  # EMA drawn over the faint raw line
    marker: bool = False
    level: float | None = None


@dataclass
class Panel:
    name: str  # file stem of its PNG
    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    caption: str = ""
    logy: bool = False


@dataclass
class Bars:
    """Shares of categories per group, drawn as stacked horizontal bars."""

    name: str
    title: str
    categories: list[str]
    groups: list[tuple[str, str, list[int]]]  # (label, colour, counts per category)
    caption: str = ""


def smoothing_weight(n: int) -> float:
    """EMA weight for a series of n points: none for a handful, up to 0.9 for long runs."""
    return 0.0 if n < 10 else min(0.9, 1.0 - 8.0 / n)


def ema(values: list[float], *, weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing): the first points are not
    pulled towards zero. Non-finite values are skipped (the previous level is repeated)."""
    out, level, seen = [], 0.0, 0
    for v in values:
        if math.isfinite(v):
            seen += 1
            level = weight * level + (1.0 - weight) * v
        out.append(level / (1.0 - weight**seen) if seen else math.nan)
    return out


def _line(run: Run, color: str, key: str, s: Series, *, label: str, style="-", smooth=True):
    w = smoothing_weight(len(s)) if smooth else 0.0
    return Line(
        label=label,
        color=color,
        steps=list(s.steps),
        values=list(s.values),
        run=run.name,
        key=key,
        style=style,
        smoothed=ema(s.values, weight=w) if w > 0 else None,
        marker=len(s) <= 3,
    )


def _metric_panel(runs, colors, key, name, title, ylabel, *, smooth=True, caption="") -> Panel:
    panel = Panel(name, title, ylabel, caption=caption)
    for run, color in zip(runs, colors):
        if key in run.train:
            panel.lines.append(
                _line(run, color, key, run.train[key], label=run.name, smooth=smooth)
            )
    return panel


def _per_teacher(runs, colors, prefix, name, title, ylabel, *, caption="") -> Panel:
    panel = Panel(name, title, ylabel, caption=caption)
    several = len(runs) > 1
    for run, color in zip(runs, colors):
        for i, t in enumerate(run.teachers):
            key = f"{prefix}/{t}"
            if key in run.train:
                label = f"{run.name} · {t}" if several else t
                style = TEACHER_STYLES[i % len(TEACHER_STYLES)]
                panel.lines.append(_line(run, color, key, run.train[key], label=label, style=style))
    return panel


def bpb_panel(runs: list[Run], colors: list[str]) -> Panel:
    panel = Panel(
        "bpb",
        "Held-out bits per byte",
        "bits / byte (lower is better)",
        caption="The student before training (step 0), at each eval interval and after; dotted: "
        "the teacher on the same held-out windows.",
    )
    refs: dict[tuple[str, float], list[tuple[Run, str]]] = {}
    for run, color in zip(runs, colors):
        s = run.student_bpb()
        if len(s):
            line = _line(run, color, "bpb", s, label=run.name, smooth=False)
            line.marker = True
            panel.lines.append(line)
        for t, v in run.teacher_bpb().items():
            refs.setdefault((t, round(v, 6)), []).append((run, color))
    for j, ((t, v), owners) in enumerate(refs.items()):
        shared = len(owners) == len(runs)  # every run measured the same teacher level
        run, color = owners[0]
        label = f"teacher {t}" if shared else f"{run.name} · teacher {t}"
        panel.lines.append(
            Line(
                label,
                REFERENCE_COLOR if shared and len(runs) > 1 else color,
                [],
                [],
                run="" if shared else run.name,
                key=f"bpb/{t}",
                level=v,
                style=REFERENCE_STYLES[j % len(REFERENCE_STYLES)],
            )
        )
    return panel


def _keys_panel(runs, colors, panel: Panel, keys: tuple[tuple[str, str, str], ...]) -> Panel:
    """`panel` with a line per run and (key, line style, what) of `keys` that run logged."""
    for run, color in zip(runs, colors):
        for key, style, what in keys:
            if key in run.train and any(run.train[key].values):
                label = f"{run.name} · {what}"
                panel.lines.append(_line(run, color, key, run.train[key], label=label, style=style))
    return panel


def step_time_panel(runs: list[Run], colors: list[str]) -> Panel:
    panel = Panel(
        "step_time",
        "Step time",
        "seconds",
        caption="Solid: wall time of an optimizer step; dashed: the teacher workers' forward "
        "time for its microbatches, which overlaps the student's step when the teacher runs ahead.",
    )
    return _keys_panel(
        runs, colors, panel, (("step_s", "-", "step"), ("teacher_s", "--", "teacher"))
    )


def mfu_panel(runs: list[Run], colors: list[str]) -> Panel:
    """Model FLOPs utilisation per device (`trainer.throughput`): none on a CPU or a GPU whose
    peak is unknown, so the panel is left out there."""
    panel = Panel(
        "mfu",
        "Model FLOPs utilisation per device",
        "fraction of the device's peak",
        caption="Solid: the student's training FLOPs (6N + 12 L H Q seq per token); dashed: the "
        "live teachers' forwards (2N + 4 L H Q seq per teacher token), on the same devices; "
        "both over the device's dense bf16 peak.",
    )
    return _keys_panel(
        runs, colors, panel, (("mfu", "-", "student"), ("teacher_mfu", "--", "teachers"))
    )


def chunk_kinds(runs: list[Run], colors: list[str]) -> Bars | None:
    """Chunk kinds of each shard folder (once per folder, however many runs read it)."""
    groups, seen = [], {}
    for run, color in zip(runs, colors):
        stats = run.shard_stats or {}
        for i, kinds in enumerate(stats.get("chunk_kinds", [])):
            names = run.summary.get("teachers") or []
            infos = stats.get("teachers") or []
            teacher = names[i] if i < len(names) else f"t{i}"
            if i >= len(names) and i < len(infos):  # unnamed in the summary: the tokenizer's name
                teacher = infos[i].get("name", teacher)
            where = (run.shards, i)
            if where in seen:
                label, c, counts = groups[seen[where]]
                groups[seen[where]] = (label.replace(" · ", f", {run.name} · ", 1), c, counts)
                continue
            seen[where] = len(groups)
            groups.append((f"{run.name} · {teacher}", color, [int(v) for v in kinds.values()]))
    if not groups:
        return None
    categories = list(next(r.shard_stats for r in runs if r.shard_stats)["chunk_kinds"][0])
    return Bars(
        "chunk_kinds",
        "Alignment chunk kinds (student : teacher tokens)",
        categories,
        groups,
        caption="Share of the shards' aligned chunks by kind, from the shards' stats.json: "
        "1:1 chunks match one token to one token; N:M chunks are where the tokenizers disagree.",
    )


def build_panels(runs: list[Run]) -> list[Panel | Bars]:
    """Every chart the runs have data for, in reading order (empty panels are left out)."""
    colors = [COLORS[i % len(COLORS)] for i in range(len(runs))]
    kd_note = "Each teacher's KD term, as weighted into the loss (nats per aligned term)."
    cov_note = (
        "KD terms (aligned tokens or chunks) per student target token: how much of the "
        "student's text the teacher's signal reaches."
    )
    panels: list[Panel | Bars | None] = [
        _metric_panel(
            runs,
            colors,
            "loss",
            "loss",
            "Training loss",
            "loss",
            caption="The loss that was minimised (KD and CE combined); faint: raw, "
            "bold: smoothed (EMA).",
        ),
        _metric_panel(runs, colors, "ce", "ce", "Cross-entropy of the student", "nats / token"),
        _per_teacher(
            runs,
            colors,
            "kd",
            "kd",
            "Distillation (KD) per teacher",
            "nats / term",
            caption=kd_note,
        ),
        bpb_panel(runs, colors),
        _metric_panel(runs, colors, "lr", "lr", "Learning rate", "lr", smooth=False),
        _metric_panel(
            runs, colors, "grad_norm", "grad_norm", "Gradient norm (before clipping)", "L2 norm"
        ),
        _metric_panel(
            runs, colors, "tokens_per_s", "tokens_per_s", "Throughput", "student tokens / s"
        ),
        _metric_panel(
            runs,
            colors,
            "tokens_per_s_per_device",
            "tokens_per_s_per_device",
            "Throughput per device",
            "student tokens / s / device",
            caption="The step's student tokens over every rank, per device (the world size), "
            "per second of step wall time.",
        ),
        _metric_panel(
            runs,
            colors,
            "padding_fraction",
            "padding",
            "Padding",
            "share of the positions computed",
            smooth=False,
            caption="The share of the student's positions of a step that hold no token: "
            "microbatches padded to their longest row, or the tails of packed rows "
            "(data.packing); beside the throughput above, what the step spent on nothing.",
        ),
        mfu_panel(runs, colors),
        _per_teacher(
            runs,
            colors,
            "coverage",
            "coverage",
            "Alignment coverage",
            "KD terms / target token",
            caption=cov_note,
        ),
        chunk_kinds(runs, colors),
        step_time_panel(runs, colors),
        _metric_panel(runs, colors, "memory_gib", "memory", "Peak memory", "GiB", smooth=False),
    ]
    return [p for p in panels if p is not None and (isinstance(p, Bars) or p.lines)]


def panel_json(p: Panel | Bars) -> dict:
    """A panel's data for report.json (NaN as null)."""
    d = asdict(p)
    for line in d.get("lines", []):
        line["values"] = finite(line["values"])
        if line["smoothed"] is not None:
            line["smoothed"] = finite(line["smoothed"])
    return d
