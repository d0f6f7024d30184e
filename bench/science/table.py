"""Renders the science table (`bench.science.experiment`'s results.json) as Markdown.

Apart from the runner so the numbers can be rendered again without a run (``--render-only``);
every sentence is computed from the payload.
"""

from __future__ import annotations

from bench.science import stats

SUITE = ("gsm8k_bpb", "math_bpb", "humaneval_bpb", "mbpp_bpb")


def _after(r: dict) -> float:
    return r["summary"]["bpb"]["student_after"]


def _by_seed(runs: list[dict], row: str, *, steps: int, phase: str = "test") -> dict[int, float]:
    return {r["seed"]: _after(r) for r in runs
            if r["row"] == row and r["steps"] == steps and r["phase"] == phase}  # fmt: skip


def _ce_at(runs: list[dict], steps: int, n: int) -> dict[int, float]:
    """CE-only's in-domain BPB by seed when trained for ``n`` steps."""
    return _by_seed(runs, "ce", steps=n, phase="test" if n == steps else "budget")


def _cell(e: stats.Estimate | None, *, signed: bool = False) -> str:
    if e is None:
        return "-"
    return e.fmt_signed() if signed else e.fmt()


def _suite_cells(suite: dict | None) -> list[str]:
    if not suite:
        return ["-"] * len(SUITE)
    return [f"{suite[t]['value']:.4f} ± {suite[t]['stderr']:.4f}" if t in suite else "-"
            for t in SUITE]  # fmt: skip


def primary(payload: dict) -> list[str]:
    """The pre-registered comparison: paired t-test of xtoken - CE-only over seeds."""
    kd, ce = payload["primary"][1], payload["primary"][0]
    runs, steps = payload["runs"], payload["steps"]
    test = stats.paired(_by_seed(runs, kd, steps=steps), _by_seed(runs, ce, steps=steps))
    head = (f"**Primary comparison** (named before any run, docs/science.md): "
            f"{payload['labels'][kd]} minus {payload['labels'][ce]}, in-domain bits per byte on the "
            "held-out test chapters, paired by seed (same initial student, data order and "
            "held-out windows)")  # fmt: skip
    if test is None:
        return [head + ": fewer than two paired seeds finished; no test."]
    return [
        f"{head}: **{test.diff.fmt_signed()}** (mean difference [95% CI]), n = {test.diff.n} "
        f"seeds, sd {test.sd:.4f}, t = {test.t:.2f}, df = {test.df}, two-sided p = "
        f"**{test.p:.3g}**. Negative means distillation reached the lower (better) BPB."
    ]


def lr_choice(payload: dict) -> list[str]:
    if payload.get("lr_given"):
        return [f"Learning rate {payload['lr']:g} was given (`--lr`), not chosen here."]
    scores: dict[tuple[str, float], list[float]] = {}
    for r in payload["val_runs"]:
        scores.setdefault((r["row"], r["lr"]), []).append(_after(r))
    rows = payload["primary"]
    lines = [
        f"Learning rate, chosen once for every row on **validation** chapters (neither trained "
        f"on nor among the test chapters), seeds {payload['lr_seeds']}: the rate with the "
        "lowest mean validation BPB of the primary pair.",
        "",
        "| lr | " + " | ".join(payload["labels"][r] for r in rows) + " | mean |",
        "|---:|" + "---:|" * (len(rows) + 1),
    ]
    for lr in sorted({lr for (_, lr) in scores}):
        vals = [scores.get((r, lr)) for r in rows]
        cells = [f"{sum(v) / len(v):.4f}" if v else "-" for v in vals]
        mean = (f"{sum(sum(v) / len(v) for v in vals) / len(vals):.4f}"
                if all(vals) else "-")  # fmt: skip
        mark = " (chosen)" if lr == payload["lr"] else ""
        lines.append(f"| {lr:g}{mark} | " + " | ".join(cells) + f" | {mean} |")
    return lines


def table(payload: dict) -> list[str]:
    runs, steps, base = payload["runs"], payload["steps"], payload.get("baselines", {})
    test = [r for r in runs if r["phase"] == "test"]
    budgets: dict[str, list[float]] = {}
    for r in test:
        budgets.setdefault(r["row"], []).append(r["budget_s"])
    ce_budget = budgets.get("ce")
    ce_step = sum(ce_budget) / len(ce_budget) / steps if ce_budget else None
    ce = _by_seed(runs, "ce", steps=steps)
    head = ["row", "seeds", "in-domain BPB, test chapters [95% CI]",
            "minus CE-only, same steps [95% CI]", "budget (core-s)",
            "minus CE-only, same budget [95% CI]", "out-of-domain BPB", *SUITE]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
    first = test[0]["summary"] if test else None
    teachers = [v for r in test for v in (r["summary"]["bpb"].get("teachers") or {}).values()]
    for label, ind, name in (("student, untouched", first and first["bpb"]["student_before"],
                              "student"),
                             ("teacher (Gemma-3-270M, untouched)",
                              teachers[0] if teachers else None, "teacher")):  # fmt: skip
        b = base.get(name, {})
        ood = next(iter(b["ood"].values())) if b.get("ood") else None
        cells = [label, "-", "-" if ind is None else f"{ind:.4f}", "-", "-", "-",
                 "-" if ood is None else f"{ood['value']:.4f} ± {ood['stderr']:.4f}",
                 *_suite_cells(b.get("suite"))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    missing = []
    for row, label in payload["rows"].items():
        mine = [r for r in test if r["row"] == row]
        if not mine:
            missing.append(label)
            continue
        by_seed = {r["seed"]: _after(r) for r in mine}
        oods = [next(iter(r["evals"]["ood"].values()))["value"] for r in mine
                if r["evals"].get("ood")]  # fmt: skip
        suite = next((r["evals"]["suite"] for r in mine if r["evals"].get("suite")), None)
        budget = sum(budgets[row]) / len(budgets[row])
        same_steps = same_budget = None
        n_eq, paired = None, 0
        if row != "ce":
            same_steps = stats.difference(by_seed, ce)
            if ce_step:
                n_eq = stats.budget_steps(budget, ce_step_s=ce_step, steps=steps)
                ce_eq = _ce_at(runs, steps, n_eq)
                same_budget = stats.difference(by_seed, ce_eq)
                paired = len(set(by_seed) & set(ce_eq))
        eq = _cell(same_budget, signed=True)
        if n_eq is not None and same_budget is not None:
            fewer = "" if paired == len(by_seed) else f", {paired} of {len(by_seed)} seeds"
            eq += f" (CE {n_eq} steps{fewer})"
        cells = [label, str(len(mine)), _cell(stats.estimate(list(by_seed.values()))),
                 _cell(same_steps, signed=True), f"{budget:.0f}", eq,
                 _cell(stats.estimate(oods)) if oods else "-", *_suite_cells(suite)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if missing:  # a partial rendering (--render-only) says what it lacks
        lines += ["", f"Not run yet (planned, no finished seed): {', '.join(missing)}."]
    return lines


def _budget_seeds(seeds: list[int]) -> str:
    if len(seeds) == 1:
        return f"seed {seeds[0]} only: one pair, a point without interval"
    return (f"seeds {', '.join(map(str, seeds))}, paired by seed (a cell names its seeds where "
            "fewer of them ran)")  # fmt: skip


def notes(payload: dict) -> list[str]:
    runs, steps, cost = payload["runs"], payload["steps"], payload["cache_cost"]
    out = [
        f"- {steps} steps of one 256-token window, AdamW at lr {payload['lr']:g} for every "
        "row. Intervals are 95% t-intervals over seeds (df = seeds - 1); differences from "
        "CE-only are paired by seed. The suite cells are the first seed's, with the eval's own "
        "standard error over examples.",
        "- Budget: training seconds times the cores a run held (one for CE-only and the cached "
        "rows, which run two at a time; two for the live-teacher rows: the student and its "
        "teacher worker), plus, for the cached rows, their share of the cache build"
        + (
            f" ({cost['core_s']:.0f} core-s for {cost['windows']} windows, "
            f"{cost['core_s'] / cost['windows']:.2f} core-s a window)"
            if cost["core_s"]
            else " (no cached row ran)"
        )
        + ". The same-budget column compares with CE-only trained for the steps that budget "
        "buys it (on a 25-step grid), "
        + _budget_seeds(payload.get("budget_seeds") or payload.get("seeds") or [0])
        + ".",
    ]
    machines = [r.get("machine") for r in runs + payload.get("val_runs", [])]
    cpus = sorted({m["cpu"] for m in machines if m})
    commits = sorted({m["commit"] for m in machines if m and m.get("commit")})
    if commits:
        out.append(f"- Runs made on commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}.")
    loads = [x for m in machines if m for x in m["load"]]
    # two one-core runs side by side load 2 cores: more than the cores means other work ran
    over = any(max(m["load"]) > m["cores"] + 0.5 for m in machines if m)
    if cpus:
        out.append(
            f"- Runs measured on {' and '.join(cpus)} ({len(cpus)} CPU model"
            f"{'s: compare budgets with care' if len(cpus) > 1 else ''}); load average at run "
            f"starts and ends {min(loads):.1f}-{max(loads):.1f}"
            f"{'; some runs overlapped other work' if over else ''}."
        )
    cached = _by_seed(runs, "xtoken", steps=steps)
    live = _by_seed(runs, "xtoken_live", steps=steps)
    both = sorted(set(cached) & set(live))
    if both:
        worst = max(abs(cached[s] - live[s]) for s in both)
        out.append(
            f"- Cached vs live teacher, same seeds {both}: largest in-domain difference "
            f"{worst:.2e} bits/byte (seed {both[0]}: {cached[both[0]]:.9f} cached, "
            f"{live[both[0]]:.9f} live)."
        )
    return out


def render(payload: dict) -> str:
    parts = [primary(payload), [""], lr_choice(payload), [""], table(payload), [""],
             notes(payload)]  # fmt: skip
    return "\n".join(line for part in parts for line in part) + "\n"
