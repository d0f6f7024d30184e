"""`make bench`: run every benchmark module and write BENCHMARKS.md.

Each module ``bench/bench_<name>.py`` has ``main() -> str`` returning a Markdown section. The
machines here are noisy, so every section quotes ratios against a baseline measured in the same
run, plus peak memory. ``python -m bench.run_all NAME ...`` runs only the named ones and keeps
the other sections of BENCHMARKS.md from their last run (cached under bench/results/).
"""

from __future__ import annotations

import importlib
import pkgutil
import platform
import sys
import time
from pathlib import Path

import bench

RESULTS = Path(__file__).parent / "results"
OUT = Path(__file__).parent.parent / "BENCHMARKS.md"


def discover() -> list[str]:
    return sorted(
        m.name[len("bench_") :]
        for m in pkgutil.iter_modules(bench.__path__)
        if m.name.startswith("bench_")
    )


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    # --collect: only rebuild BENCHMARKS.md from the sections already in bench/results/
    names = [] if "--collect" in args else (args or discover())
    RESULTS.mkdir(exist_ok=True)
    for name in names:
        print(f"== bench {name}", flush=True)
        t0 = time.perf_counter()
        section = importlib.import_module(f"bench.bench_{name}").main()
        took = time.perf_counter() - t0
        if "_(cached:" in section:  # a section this machine cannot measure kept its last run
            print(f"   {name}: kept the cached section (not measurable here)")
            continue
        (RESULTS / f"{name}.md").write_text(
            section.rstrip() + f"\n\n_(section ran in {took:.0f} s)_\n"
        )
    parts = [
        "# Benchmarks\n",
        f"Written by `make bench`. Machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
        "2 cores / 24 GiB, no GPU unless a section says so. Every figure is a ratio against a "
        "baseline measured in the same run, plus peak memory.\n",
    ]
    parts += [
        (RESULTS / f"{n}.md").read_text() for n in discover() if (RESULTS / f"{n}.md").exists()
    ]
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text("\n".join(parts))
    tmp.replace(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
