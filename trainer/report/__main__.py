"""`python -m trainer.report RUN_DIR [RUN_DIR ...] [--out DIR]`

Writes report.html (self-contained: charts embedded, opens offline), a PNG per chart and
report.json (the plotted numbers) for one run, or for several runs side by side on the same
axes, each run a colour. Default output: RUN_DIR/report for one run, RUN_DIR/report-vs-<others>
for several. A folder that is not a run folder: one line and exit code 2 (`tokenbridge.cli`).
"""

from __future__ import annotations

import argparse
import sys

from tokenbridge import cli, urls
from trainer.report.build import write_report


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv, prog="report")


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("runs", nargs="+", help="run folders (runs/<name>)")
    ap.add_argument("--out", default=None, help="output folder (default: see above)")
    args = ap.parse_args(argv)
    runs = [urls.local(urls.check(r, where="run folder", doing="reading")) for r in args.runs]
    out = urls.check(args.out, where="--out", doing="writing a report to")
    path = write_report(runs, out=None if out is None else urls.local(out))
    print(f"run report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
