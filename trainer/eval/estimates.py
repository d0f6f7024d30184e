"""Estimates with standard errors, for one model and for the paired difference of two.

Per-example values are kept with every result, so two models on the same examples are compared
paired (far tighter than two independent errors); ratios of sums such as bits per byte use the
delta method (docs/eval.md, "Benchmarks").
"""

from __future__ import annotations

import math

import numpy as np

# metric name -> ("mean", value field) or ("ratio", numerator field, denominator field)
METRICS: dict[str, dict[str, tuple[str, ...]]] = {
    "mc": {
        "acc": ("mean", "acc"),
        "acc_norm": ("mean", "acc_norm"),
        "acc_per_token": ("mean", "acc_per_token"),
        "bpb": ("ratio", "bits", "bytes"),
    },
    "lastword": {"acc": ("mean", "acc"), "bpb": ("ratio", "bits", "bytes")},
    "gold_bpb": {"bpb": ("ratio", "bits", "bytes"), "bits_per_token": ("ratio", "bits", "tokens")},
    "text": {"bpb": ("ratio", "bits", "bytes"), "bits_per_token": ("ratio", "bits", "tokens")},
    "gen": {"em": ("mean", "em")},
    "code": {"pass@1": ("mean", "em")},
}
# rows the Markdown table shows per kind (everything is in the JSON)
SHOWN = {"mc": ("acc", "acc_norm", "bpb"), "lastword": ("acc", "bpb"), "gold_bpb": ("bpb",)}
SHOWN |= {"text": ("bpb",), "gen": ("em",), "code": ("pass@1",)}


def mean_se(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0
    return float(x.mean()), se


def ratio_se(num, den) -> tuple[float, float]:
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if num.size == 0 or den.sum() <= 0:
        return math.nan, math.nan
    r = float(num.sum() / den.sum())
    if num.size < 2:
        return r, 0.0
    resid = num - r * den
    return r, float(resid.std(ddof=1) / (math.sqrt(num.size) * den.mean()))


def estimate(spec: tuple[str, ...], samples: dict[str, list]) -> tuple[float, float]:
    if spec[0] == "mean":
        return mean_se(samples[spec[1]])
    return ratio_se(samples[spec[1]], samples[spec[2]])


def summarize(kind: str, samples: dict[str, list]) -> dict[str, dict[str, float]]:
    """Every metric of a task kind from its per-example samples."""
    out = {}
    for name, spec in METRICS[kind].items():
        value, se = estimate(spec, samples)
        out[name] = {"value": value, "stderr": se}
    return out


def paired_diff(
    spec: tuple[str, ...], a: dict[str, list], b: dict[str, list]
) -> tuple[float, float, int]:
    """(b - a, its standard error, n) over the example ids both runs scored."""
    ia = {k: i for i, k in enumerate(a["id"])}
    pairs = [(ia[k], j) for j, k in enumerate(b["id"]) if k in ia]
    if not pairs:
        return math.nan, math.nan, 0
    sa, sb = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])

    def col(s: dict[str, list], field: str, idx: np.ndarray) -> np.ndarray:
        return np.asarray(s[field], dtype=np.float64)[idx]

    n = len(pairs)
    if spec[0] == "mean":
        d = col(b, spec[1], sb) - col(a, spec[1], sa)
        return mean_se(d) + (n,)

    def resid(s: dict[str, list], idx: np.ndarray) -> tuple[float, np.ndarray]:
        num, den = col(s, spec[1], idx), col(s, spec[2], idx)
        r = num.sum() / den.sum()
        return float(r), (num - r * den) / den.mean()

    ra, za = resid(a, sa)
    rb, zb = resid(b, sb)
    se = float((zb - za).std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return rb - ra, se, n
