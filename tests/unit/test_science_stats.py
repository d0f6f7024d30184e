"""The science table's statistics, its plan and its rendering, on synthetic results (no runs).

The references are scipy's own tests and intervals (`scipy.stats.ttest_rel`, `t.interval`),
computed independently of `bench.science.stats`'s formulas.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from scipy import stats

from bench.science import experiment
from bench.science import stats as science_stats  # scipy's is `stats` here
from bench.science.table import render


def test_paired_test_matches_scipy_ttest_rel():
    a = {0: 1.10, 1: 1.12, 2: 1.09, 3: 1.115, 4: 1.105}
    b = {0: 1.11, 1: 1.125, 2: 1.10, 3: 1.112, 4: 1.12, 9: 3.0}  # seed 9: unpaired, ignored
    got = science_stats.paired(a, b)
    seeds = sorted(a)
    ref = stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds])
    assert got.df == 4 and got.diff.n == 5
    assert got.t == pytest.approx(ref.statistic, rel=1e-12)
    assert got.p == pytest.approx(ref.pvalue, rel=1e-9)
    d = [a[s] - b[s] for s in seeds]
    lo, hi = stats.t.interval(0.95, 4, loc=sum(d) / 5, scale=stats.sem(d))
    assert (got.diff.lo, got.diff.hi) == (pytest.approx(lo), pytest.approx(hi))
    assert science_stats.paired({0: 1.0}, {0: 2.0}) is None  # one pair: no test


def test_estimate_interval_and_single_value():
    xs = [1.0, 1.2, 1.1]
    e = science_stats.estimate(xs)
    lo, hi = stats.t.interval(0.95, 2, loc=1.1, scale=stats.sem(xs))
    assert (e.mean, e.lo, e.hi) == (pytest.approx(1.1), pytest.approx(lo), pytest.approx(hi))
    one = science_stats.estimate([1.5])
    assert one.lo is None and one.fmt() == "1.5000"


def test_lr_choice_uses_only_rates_every_row_ran():
    val = {
        ("ce", 1e-4): [1.20],
        ("xtoken", 1e-4): [1.10],
        ("ce", 5e-5): [1.16],
        ("xtoken", 5e-5): [1.13],
        ("ce", 2e-4): [1.00],
    }  # fmt: skip  (2e-4: xtoken never ran, not a candidate)
    assert science_stats.choose_lr(val, ("ce", "xtoken")) == 5e-5
    with pytest.raises(ValueError, match="no learning rate"):
        science_stats.choose_lr({("ce", 1e-4): [1.0]}, ("ce", "xtoken"))


def test_budget_steps():
    assert science_stats.budget_steps(42.0, ce_step_s=1.0, steps=40) == 40  # within 10%
    assert science_stats.budget_steps(97.0, ce_step_s=1.0, steps=40) == 100  # 25-step grid
    assert science_stats.budget_steps(112.0, ce_step_s=1.0, steps=40) == 100
    assert science_stats.budget_steps(97.0, ce_step_s=1.0, steps=40, grid=5) == 95
    assert science_stats.run_budget(100.0, cores=2, cache_share_s=7.0) == 207.0


def _args(tmp_path: Path, **kw) -> argparse.Namespace:
    base = dict(out=tmp_path, rows=list(experiment.ROWS), primary_seeds=[0, 1, 2, 3, 4],
                seeds=[0, 1, 2], steps=40, lr_grid=[5e-5, 1e-4], lr_seeds=[0],
                suite_rows=["ce", "xtoken"], budget_seeds=[0], set=[])  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_plan_seeds_splits_and_phases(tmp_path):
    args = _args(tmp_path)
    val = experiment.plan_lr(args)
    assert {(j.row, j.lr) for j in val} == {
        (r, lr) for r in ("ce", "xtoken") for lr in (5e-5, 1e-4)
    }
    assert all("data.eval_on=val" in j.cmd and "data.val_fraction=0.1" in j.cmd for j in val)
    table = experiment.plan_table(args, 5e-5)
    seeds = {r: sorted(j.seed for j in table if j.row == r) for r in experiment.ROWS}
    assert seeds["ce"] == seeds["xtoken"] == [0, 1, 2, 3, 4]
    assert all(seeds[r] == [0, 1, 2] for r in experiment.ROWS if r not in experiment.PRIMARY)
    # the table's runs train on the same chapters as the learning-rate runs, scored on test
    assert all("data.val_fraction=0.1" in j.cmd and "data.eval_on=val" not in j.cmd for j in table)
    assert {j.cores for j in table if j.row == "gold"} == {2}
    # budget: gold cost 2.5x CE a run, alm 2.4x -> one CE run at 100 steps, on --budget-seeds
    runs = [{"row": r, "phase": "test", "budget_s": b, "seed": 0}
            for r, b in (("ce", 40.0), ("xtoken", 41.0), ("gold", 100.0),
                         ("alm", 96.0))]  # fmt: skip
    extra = experiment.plan_budget(args, 5e-5, runs)
    assert {(j.row, j.steps, j.seed) for j in extra} == {("ce", 100, 0)}
    assert all("steps=100" in j.cmd for j in extra)
    extra = experiment.plan_budget(_args(tmp_path, budget_seeds=[0, 1, 2]), 5e-5, runs)
    assert {(j.row, j.steps, j.seed) for j in extra} == {("ce", 100, s) for s in (0, 1, 2)}


def _run(row, seed, bpb, *, steps=40, phase="test", budget=40.0):
    return {"row": row, "seed": seed, "lr": 5e-5, "steps": steps, "phase": phase, "cores": 1,
            "budget_s": budget, "evals": {},
            "summary": {"bpb": {"student_before": 1.19, "student_after": bpb,
                                "teachers": {}}}}  # fmt: skip


def test_render_states_the_test_the_choice_and_the_equal_budget_runs():
    ce = [1.110, 1.112, 1.108, 1.111, 1.109]
    kd = [1.100, 1.104, 1.101, 1.099, 1.103]
    runs = [_run("ce", s, v) for s, v in enumerate(ce)]
    runs += [_run("xtoken", s, v, budget=44.0) for s, v in enumerate(kd)]
    runs += [_run("gold", s, 1.105, budget=100.0) for s in range(3)]
    runs += [_run("ce", s, 1.090 + s / 1000, steps=100, phase="budget") for s in range(3)]
    val = [dict(_run(r, 0, v), lr=lr, phase="val")
           for r, lr, v in (("ce", 5e-5, 1.2), ("xtoken", 5e-5, 1.1),
                            ("ce", 1e-4, 1.3), ("xtoken", 1e-4, 1.2))]  # fmt: skip
    payload = {"steps": 40, "lr": 5e-5, "lr_given": False, "lr_seeds": [0], "val_runs": val,
               "primary": ["ce", "xtoken"], "rows": {k: experiment.ROWS[k].label
               for k in ("ce", "xtoken", "gold")}, "runs": runs, "baselines": {},
               "cache_cost": {"core_s": 360.0, "windows": 360}, "budget_seeds": [0, 1, 2],
               "labels": {k: r.label for k, r in experiment.ROWS.items()}}  # fmt: skip
    runs[0]["machine"] = {"cpu": "AMD EPYC", "cores": 2, "load": [1.0, 1.9], "commit": "e375e37"}
    val[0]["machine"] = {"cpu": "AMD EPYC", "cores": 2, "load": [3.3, 3.8], "commit": "07b5fd5"}
    text = render(payload)
    assert "- Runs made on commits 07b5fd5, e375e37." in text
    assert "load average at run starts and ends 1.0-3.8; some runs overlapped" in text
    ref = stats.ttest_rel(kd, ce)
    assert f"t = {ref.statistic:.2f}, df = 4, two-sided p = **{ref.pvalue:.3g}**" in text
    assert "| 5e-05 (chosen) | 1.2000 | 1.1000 | 1.1500 |" in text
    gold = next(line for line in text.splitlines() if line.startswith("| gold"))
    # same steps: gold - ce over seeds 0-2; same budget: gold - ce@100 steps
    same_steps = sum(1.105 - c for c in ce[:3]) / 3
    same_budget = sum(1.105 - (1.090 + s / 1000) for s in range(3)) / 3
    assert f"{same_steps:+.4f} [" in gold and f"{same_budget:+.4f} [" in gold
    assert "(CE 100 steps)" in gold and "| 100 |" in gold
    assert "(on a 25-step grid), seeds 0, 1, 2, paired by seed (a cell names" in text
    # a budget run missing for some seeds: the cell pairs the others and says how many
    payload["runs"] = [r for r in runs if not (r["phase"] == "budget" and r["seed"] == 2)]
    gold = next(line for line in render(payload).splitlines() if line.startswith("| gold"))
    assert "(CE 100 steps, 2 of 3 seeds)" in gold
    assert "goal" not in text.lower() and "met" not in text.split()
    assert "Not run yet" not in text
    payload["rows"]["alm"] = experiment.ROWS["alm"].label  # planned, nothing finished
    assert "Not run yet (planned, no finished seed): alm." in render(payload)


def test_render_only_builds_nothing(tmp_path):
    """``--render-only`` with no finished inputs refuses; it must never rebuild the shared
    teacher cache the running rows read."""
    with pytest.raises(SystemExit, match="render-only: no"):
        experiment.main(["--render-only", "--out", str(tmp_path / "none")])
    assert not (tmp_path / "none" / "cache.log").exists()
