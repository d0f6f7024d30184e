"""The README and docs/*.md quote measured figures from BENCHMARKS.md only (issue 28).

Every number that carries a unit (s, min, GiB, MB, x, %, tokens/s, GB/s, bits/byte, ...) in
README.md or docs/*.md must appear with the same value and unit in BENCHMARKS.md, which `make
bench` writes. BENCHMARKS.md counts a table cell that is a bare number as carrying its column's
unit (`| job s |` over `| 22.4 |` is 22.4 s). A range ("10-40 s", "1.2 to 1.3x") is each of its
ends. The only other figures allowed are stated design constants and limits (a default, a
timeout, a budget), each listed in ALLOWED below with its reason. A measured figure that is not
in BENCHMARKS.md does not belong in the docs: name the BENCHMARKS.md section that measures it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e-?\d+)?"
# unit as written -> unit compared; longest first in the pattern, so that "tokens/s" is not read
# as "s" and "minutes" not as "min"
_UNITS = {
    "tokens/s": "tokens/s",
    "TFLOP/s": "TFLOP/s",
    "GB/s": "GB/s",
    "MB/s": "MB/s",
    "bits/byte": "bits/byte",
    "bits per byte": "bits/byte",
    "nats": "nats",
    "bytes": "bytes",
    "seconds": "s",
    "second": "s",
    "minutes": "min",
    "minute": "min",
    "min": "min",
    "hours": "h",
    "hour": "h",
    "TiB": "TiB",
    "GiB": "GiB",
    "MiB": "MiB",
    "KiB": "KiB",
    "TB": "TB",
    "GB": "GB",
    "MB": "MB",
    "KB": "KB",
    "kB": "KB",
    "ms": "ms",
    "us": "us",
    "µs": "us",
    "s": "s",
    "%": "%",
    "x": "x",
    "×": "x",
}
_SPACED = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True) if u not in "x×")
_SCALE = {None: 1.0, "k": 1e3, "M": 1e6}
# a number (or a range of two), an optional k / M, then its unit: after a space or attached
# ("5 s", "128MB", "0.6 %"), except a ratio, which is attached only ("1.6x"; "2 x 64" is a shape)
_FIGURE = re.compile(
    rf"(?<![\w.])(?<!\w-)(?P<a>{_NUM})(?:\s*(?:-|–|to|\.\.)\s*(?P<b>{_NUM}))?"
    rf"(?:\s?(?P<scale>[kM]))?"
    rf"(?:\s?(?P<unit>{_SPACED})|(?P<ratio>[x×]))(?![\w/])"
)
_CELL_NUM = re.compile(rf"^\**~?(?P<a>{_NUM})\s?(?P<scale>[kM])?\**$")


def _value(text: str, scale: str | None = None) -> float:
    return round(float(text.replace(",", "")) * _SCALE[scale], 9)


def figures(line: str) -> list[tuple[str, float, str]]:
    """(as written, value, unit) of each unit-bearing figure of a line; a range gives both ends."""
    out = []
    for m in _FIGURE.finditer(line):
        unit = _UNITS[m.group("unit") or m.group("ratio")]
        for end in ("a", "b"):
            if m.group(end):
                out.append((m.group(0), _value(m.group(end), m.group("scale")), unit))
    return out


def _column_unit(header: str) -> str | None:
    for word in re.split(r"[\s()]+", header.strip(" *")):
        if word in _UNITS:
            return _UNITS[word]
    return None


def benchmark_figures(text: str) -> set[tuple[float, str]]:
    """Every (value, unit) BENCHMARKS.md states, in its prose or its tables."""
    found = {(v, u) for line in text.splitlines() for _, v, u in figures(line)}
    units: list[str | None] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            units = []
            continue
        cells = line.strip().strip("|").split("|")
        if not units:
            units = [_column_unit(c) for c in cells]
            continue
        for cell, unit in zip(cells, units):
            m = _CELL_NUM.match(cell.strip())
            if m and unit:
                found.add((_value(m.group("a"), m.group("scale")), unit))
    return found


@dataclass(frozen=True)
class Allowed:
    """Figures (as written) that are no measurement, on the lines of `path` that `context` (a
    regular expression) finds: a design constant or limit, stated with its `reason`."""

    path: str
    context: str
    figures: tuple[str, ...]
    reason: str


ALLOWED = (
    Allowed("README.md", r"`--shard-mb` \(128 MB\)", ("1 MB", "128 MB"),
            "defaults: text per tokenization batch (align_dofns.BATCH_CHARS, 1 M characters) "
            "and the shard roll size (pipelines/align/job.py ROLL_MB)"),
    Allowed("README.md", r"^Progress goes to stderr every", ("10 s",),
            "the progress interval (pipelines/plumbing/progress.py, interval=10.0)"),
    Allowed("README.md", r"before rank 0 says it too", ("3 s",),
            "how long a failing rank waits for rank 0's line (tokenbridge/cli.py PEER_WAIT_S)"),
    Allowed("README.md", r"gpu-check|under 6 minutes", ("6 min", "6 minutes"),
            "the GPU check's whole budget (bench/gpu/check.py BUDGET_S, 355 s + start-up)"),
    Allowed("docs/gpu.md", r"^One command, under 6 minutes", ("6 minutes",),
            "the GPU check's whole budget (bench/gpu/check.py BUDGET_S, 355 s + start-up)"),
    Allowed("docs/gpu.md", r"^\| \d\. `\w+` \| \d+ s \|",
            ("90 s", "25 s", "100 s", "65 s", "30 s", "45 s"),
            "each part's time budget (bench/gpu/check.py parts())"),
    Allowed("docs/gpu.md", r"own budget \(355 s in all|the check keeps to 355 s", ("355 s",),
            "the GPU check's budget (bench/gpu/check.py BUDGET_S)"),
    Allowed("docs/gpu.md", r"under the 64 MiB limit", ("64 MiB",),
            "the device tool's limit on what a GPU run carries (docs/gpu.md, its own section)"),
    Allowed("docs/integrity.md", r"DamagedFileError: .* over 61234 bytes", ("61234 bytes",),
            "an example error message: a file size made up for the example"),
    Allowed("docs/losses.md", r"asserts that the bound is under 1 %", ("1 %",),
            "the e2e test's limit (tests/e2e/test_teacher_cache.py BOUND_SHARE_OF_KD)"),
    Allowed("docs/onpolicy.md", r"\(tested: < 10 s\)", ("10 s",),
            "the e2e test's limit (tests/e2e/test_onpolicy_run.py: seconds < 10)"),
    Allowed("docs/parallelism.md", r"\[T, V\] fp32 is 3 GiB|and 18.5 GiB for a 32k-token row",
            ("3 GiB", "18.5 GiB"),
            "sizes of the stated shapes, by arithmetic (16,384 x 49,152 and 32,768 x 151,936 "
            "fp32 values), not measured"),
    Allowed("docs/science.md", r"95% (interval|t-interval)", ("95%",),
            "the science protocol's confidence level (bench/science/stats.py level=0.95)"),
    Allowed("docs/science.md", r"cosine to 10%", ("10%",),
            "the LR schedule's floor (optim.min_lr_ratio = 0.1, conf/train.yaml)"),
    Allowed("docs/training.md", r"A100 312 TFLOP/s", ("312 TFLOP/s",),
            "a datasheet peak (tokenbridge/flops.py PEAK_TFLOPS)"),
)  # fmt: skip


def _doc_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_quote_measured_figures_from_benchmarks_only():
    measured = benchmark_figures((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))
    unused = {(a, f) for a in ALLOWED for f in a.figures}
    bad = []
    for path in _doc_paths():
        rel = path.relative_to(ROOT).as_posix()
        allowed_here = [a for a in ALLOWED if a.path == rel]
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for written, value, unit in figures(line):
                # a stated constant first, so that one a benchmark happens to share is still
                # declared as what it is
                hits = [
                    (a, written)
                    for a in allowed_here
                    if written in a.figures and re.search(a.context, line)
                ]
                if hits:
                    unused.difference_update(hits)
                elif (value, unit) not in measured and f"{rel}:{n}: {written!r}" not in bad:
                    bad.append(f"{rel}:{n}: {written!r}")  # once for a range, either end
    assert not bad, (
        "figures in README.md / docs that BENCHMARKS.md does not state: name the BENCHMARKS.md "
        "section that measures them instead (or, for a design constant or limit, add it to "
        "ALLOWED with its reason):\n" + "\n".join(bad)
    )
    stale = sorted(f"{a.path}: {f!r} ({a.context!r})" for a, f in unused)
    assert not stale, "ALLOWED entries that match nothing any more:\n" + "\n".join(stale)


def test_the_figure_reader():
    assert figures("took 10 to 40 s instead of the ~5 s") == [
        ("10 to 40 s", 10.0, "s"),
        ("10 to 40 s", 40.0, "s"),
        ("5 s", 5.0, "s"),
    ]
    assert [f[1:] for f in figures("~1.2-1.3x the time, 4,096 tokens, 2 x 64, 33%")] == [
        (1.2, "x"),
        (1.3, "x"),
        (33.0, "%"),
    ]
    line = "3.29 GB/s, 1,927 MiB, 63.72M tokens/s, 0.9 bits/byte, 1.1e-03 nats, -6.0%, UTF-8 bytes"
    assert [f[1:] for f in figures(line)] == [
        (3.29, "GB/s"),
        (1927.0, "MiB"),
        (63720000.0, "tokens/s"),
        (0.9, "bits/byte"),
        (0.0011, "nats"),
        (6.0, "%"),
    ]
    table = "| run | job s (wall) | rows/s |\n|---|---:|---:|\n| a | 22.4 | 382 |\n"
    assert benchmark_figures(table) == {(22.4, "s")}
