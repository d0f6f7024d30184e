"""The statistics of the science table, as pure functions.

The table rests on few seeds, so every figure carries its uncertainty, and its one test of
significance (xtoken forward vs CE-only, paired by seed) was named before any run; every other
row is an estimate with an interval. docs/science.md states the protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats


@dataclass(frozen=True)
class Estimate:
    """A mean with its two-sided confidence interval (lo/hi None from one value)."""

    n: int
    mean: float
    lo: float | None
    hi: float | None

    def fmt(self, digits: int = 4) -> str:
        if self.lo is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"

    def fmt_signed(self, digits: int = 4) -> str:
        if self.lo is None:
            return f"{self.mean:+.{digits}f}"
        return f"{self.mean:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"


@dataclass(frozen=True)
class PairedTest:
    """The paired t-test of a - b over the seeds both have."""

    diff: Estimate
    sd: float
    t: float
    df: int
    p: float


def estimate(xs: list[float], *, level: float = 0.95) -> Estimate:
    """Mean and its t-interval (sample standard deviation, df = n - 1)."""
    n = len(xs)
    if n == 0:
        raise ValueError("an estimate needs at least one value")
    m = sum(xs) / n
    if n < 2:
        return Estimate(n, m, None, None)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * _sd(xs) / math.sqrt(n)
    return Estimate(n, m, m - half, m + half)


def _sd(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def paired(a: dict[int, float], b: dict[int, float], *, level: float = 0.95) -> PairedTest | None:
    """a - b on the seeds both have (None when there are fewer than two: no test)."""
    seeds = sorted(set(a) & set(b))
    d = [a[s] - b[s] for s in seeds]
    if len(d) < 2:
        return None
    sd = _sd(d)
    n = len(d)
    m = sum(d) / n
    if sd == 0:
        t = math.copysign(math.inf, m) if m else 0.0
        p = 0.0 if m else 1.0
    else:
        t = m / (sd / math.sqrt(n))
        p = float(2 * stats.t.sf(abs(t), n - 1))
    return PairedTest(estimate(d, level=level), sd, t, n - 1, p)


def difference(a: dict[int, float], b: dict[int, float]) -> Estimate | None:
    """a - b paired by seed, as an estimate (a point without interval from one pair; None
    from none)."""
    seeds = sorted(set(a) & set(b))
    return estimate([a[s] - b[s] for s in seeds]) if seeds else None


def choose_lr(val: dict[tuple[str, float], list[float]], rows: tuple[str, ...]) -> float:
    """The learning rate whose mean validation BPB over ``rows`` (each row's seeds averaged
    first) is lowest; only rates every row was run at are candidates."""
    lrs = {lr for (_, lr) in val}
    full = [lr for lr in lrs if all(val.get((r, lr)) for r in rows)]
    if not full:
        raise ValueError(f"no learning rate has validation runs of every row {rows}")

    def score(lr: float) -> float:
        return sum(sum(val[(r, lr)]) / len(val[(r, lr)]) for r in rows) / len(rows)

    return min(sorted(full), key=score)


def budget_steps(
    budget_s: float, *, ce_step_s: float, steps: int, tol: float = 0.1, grid: int = 25
) -> int:
    """The CE-only steps a budget of ``budget_s`` core-seconds buys, on a grid of ``grid``
    steps (rows of near budgets share one CE run: each costs as much as a KD run), or
    ``steps`` itself when that is within ``tol`` of it (the equal-steps runs serve)."""
    if ce_step_s <= 0:
        raise ValueError(f"CE-only step cost must be positive, got {ce_step_s}")
    n = budget_s / ce_step_s
    if abs(n - steps) <= tol * steps:
        return steps
    return max(grid, grid * round(n / grid))


def run_budget(train_s: float, *, cores: int, cache_share_s: float = 0.0) -> float:
    """Core-seconds a run cost: its training seconds times the cores it held, plus its share
    of the teacher-cache build (the build's core-seconds times the fraction of the cached
    windows it read)."""
    return train_s * cores + cache_share_s
