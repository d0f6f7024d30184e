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

_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# unit as written -> unit compared; longest first in the pattern, so that "tokens/s" is not read
# as "s" and "minutes" not as "min"
_UNITS = {
    "tokens/s": "tokens/s",
    "TFLOP/s": "TFLOP/s",
    "GB/s": "GB/s",
    "MB/s": "MB/s",
    "bits/byte": "bits/byte",
    "bits per byte": "bits/byte",
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
    rf"(?<![\w.])(?P<a>{_NUM})(?:\s*(?:-|–|to|\.\.)\s*(?P<b>{_NUM}))?"
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
    """A design constant or limit the docs may state: `figures` (as written) on a line of `path`
    that contains `context`."""

    path: str
    context: str
    figures: tuple[str, ...]
    reason: str


ALLOWED = (
    # filled in below
)


def _doc_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_quote_measured_figures_from_benchmarks_only():
    measured = benchmark_figures((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))
    unused = {(a, f) for a in ALLOWED for f in a.figures}
    bad = []
    for path in _doc_paths():
        rel = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for written, value, unit in figures(line):
                if (value, unit) in measured:
                    continue
                allowed = [
                    (a, written)
                    for a in ALLOWED
                    if a.path == rel and a.context in line and written in a.figures
                ]
                if allowed:
                    unused.difference_update(allowed)
                    continue
                bad.append(f"{rel}:{n}: {written!r} is not in BENCHMARKS.md")
    assert not bad, (
        "figures in the docs that BENCHMARKS.md does not state (name its section instead, "
        "or, for a design constant, add it to ALLOWED with the reason):\n" + "\n".join(bad)
    )
    stale = [f"{a.path}: {f!r} near {a.context!r}" for a, f in sorted(unused, key=str)]
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
    assert [f[1:] for f in figures("3.29 GB/s, 1,927 MiB, 63.72M tokens/s, 0.9 bits/byte")] == [
        (3.29, "GB/s"),
        (1927.0, "MiB"),
        (0.9, "bits/byte"),
    ]
    table = "| run | job s (wall) | rows/s |\n|---|---:|---:|\n| a | 22.4 | 382 |\n"
    assert benchmark_figures(table) == {(22.4, "s")}
