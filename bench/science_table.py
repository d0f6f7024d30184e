"""Renders the science table (``bench/science.py``'s results.json) as Markdown, goals included.

Kept apart from the runner so the numbers can be re-rendered without a run, and so the
aggregation (mean and standard error over seeds, the goal checks) is a pure function the
tests pin (tests/unit/test_science_table.py).
"""

from __future__ import annotations

import math
from collections import defaultdict

SUITE = ("gsm8k_bpb", "math_bpb", "humaneval_bpb", "mbpp_bpb")
KD_ROWS_EXCLUDED = ("ce", "xtoken_live")  # not candidates for "the best KD row"


def mean_se(xs: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample std / sqrt n); SE None for one value."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def fmt(m: float, se: float | None) -> str:
    return f"{m:.4f}" if se is None else f"{m:.4f} ± {se:.4f}"


def collect(payload: dict) -> dict[tuple[str, float], list[dict]]:
    """Runs grouped by (row, lr)."""
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in payload["runs"]:
        groups[(r["row"], float(r["lr"]))].append(r)
    return groups


def row_stats(runs: list[dict]) -> dict:
    """One table row: in-domain, OOD, suite (first seed's, with its own SE), train seconds."""
    ind = mean_se([r["summary"]["bpb"]["student_after"] for r in runs])
    ood_vals = [r["evals"]["ood"] for r in runs if "ood" in r.get("evals", {})]
    ood = mean_se([next(iter(v.values()))["value"] for v in ood_vals]) if ood_vals else None
    suite = next((r["evals"]["suite"] for r in runs if "suite" in r.get("evals", {})), None)
    secs = mean_se([r["summary"]["train_seconds"] for r in runs])
    return {"in": ind, "ood": ood, "suite": suite, "secs": secs, "n": len(runs)}


def _suite_cells(suite: dict | None) -> list[str]:
    if not suite:
        return ["-"] * len(SUITE)
    return [fmt(suite[t]["value"], suite[t]["stderr"]) if t in suite else "-" for t in SUITE]


def goals(
    payload: dict, stats: dict[str, dict], *, before: float, teacher: float | None
) -> list[str]:
    """The issue's four goals, as measured (whatever they turn out to be)."""
    kd = {k: s for k, s in stats.items() if k not in KD_ROWS_EXCLUDED}
    if "ce" not in stats or not kd:
        return ["- (goals need the CE row and at least one KD row)"]
    best = min(kd, key=lambda k: kd[k]["in"][0])
    (bm, bse), (cm, cse) = kd[best]["in"], stats["ce"]["in"]
    diff_se = math.sqrt((bse or 0) ** 2 + (cse or 0) ** 2)
    k_se = (cm - bm) / diff_se if diff_se > 0 else float("inf")
    out = [
        f"- Best KD row: **{payload['rows'][best]}** ({fmt(bm, bse)}) vs CE-only "
        f"({fmt(cm, cse)}): {cm - bm:+.4f} bits/byte in its favour, {k_se:.1f} standard errors "
        f"of the difference; goal >= 2: **{'met' if k_se >= 2 else 'missed'}**."
    ]
    if teacher is not None and before > teacher:
        closed = (before - bm) / (before - teacher)
        ce_closed = (before - cm) / (before - teacher)
        out.append(
            f"- Gap closed (student {before:.4f} -> teacher {teacher:.4f}): best KD "
            f"{100 * closed:.0f}%, CE-only {100 * ce_closed:.0f}%; goal >= 40%: "
            f"**{'met' if closed >= 0.4 else 'missed'}**."
        )
    if "trl_gold" in stats:
        tm, tse = stats["trl_gold"]["in"]
        out.append(
            f"- vs TRL's GOLD loss in our trainer ({fmt(tm, tse)}): best KD "
            f"{tm - bm:+.4f} in its favour; goal: **{'met' if bm < tm else 'missed'}**."
        )
    base = payload.get("baselines", {}).get("student", {}).get("suite")
    if base:
        worse = []
        for k, s in stats.items():
            for t in SUITE:
                if s["suite"] and t in s["suite"] and t in base:
                    d = s["suite"][t]["value"] - base[t]["value"]
                    if d > base[t]["stderr"]:
                        worse.append(f"{payload['rows'][k]} {t} {d:+.3f}")
        out.append(
            "- Eval-suite bits-per-byte rows worse than the untouched student by more than its "
            f"standard error: {', '.join(worse) if worse else 'none'}; goal: "
            f"**{'met' if not worse else 'missed'}**."
        )
    return out


def render(payload: dict) -> str:
    groups = collect(payload)
    lr = float(payload["lr"])
    stats = {row: row_stats(runs) for (row, g_lr), runs in groups.items() if g_lr == lr}
    first = payload["runs"][0]["summary"]
    before = first["bpb"]["student_before"]
    teachers = [
        v for r in payload["runs"] for v in (r["summary"]["bpb"].get("teachers") or {}).values()
    ]
    teacher = teachers[0] if teachers else None
    base = payload.get("baselines", {})
    head = [
        "row",
        "in-domain BPB (held-out chapters)",
        "out-of-domain BPB",
        *SUITE,
        "train s",
        "seeds",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def base_row(label: str, ind: float | None, name: str) -> str:
        b = base.get(name, {})
        ood = next(iter(b["ood"].values())) if b.get("ood") else None
        cells = [label, "-" if ind is None else f"{ind:.4f}",
                 "-" if ood is None else fmt(ood["value"], ood["stderr"]),
                 *_suite_cells(b.get("suite")), "-", "-"]  # fmt: skip
        return "| " + " | ".join(cells) + " |"

    lines.append(base_row("student, untouched", before, "student"))
    lines.append(base_row("teacher (Gemma-3-270M, untouched)", teacher, "teacher"))
    for row, s in stats.items():
        cells = [payload["rows"][row], fmt(*s["in"]), "-" if s["ood"] is None else fmt(*s["ood"]),
                 *_suite_cells(s["suite"]), f"{s['secs'][0]:.0f}", str(s["n"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lr_rows = sorted({row for (row, g_lr) in groups if g_lr != lr})
    if lr_rows:
        lines += ["", "Learning-rate check (first seed):", "",
                  "| row | lr | in-domain BPB | out-of-domain BPB |", "|---|---:|---:|---:|"]  # fmt: skip
        for row in lr_rows:
            for (r, g_lr), runs in sorted(groups.items()):
                if r == row:
                    s = row_stats(runs[:1])
                    ood = "-" if s["ood"] is None else f"{s['ood'][0]:.4f}"
                    lines.append(
                        f"| {payload['rows'][row]} | {g_lr:g} | {s['in'][0]:.4f} | {ood} |"
                    )
    lines += ["", "Goals (measured):", "", *goals(payload, stats, before=before, teacher=teacher)]
    return "\n".join(lines) + "\n"
