"""Merge several `bench.gpu.check` runs into one result: each part from the newest run that ran it.

A GPU is lent for minutes: a first run finds what breaks, a rerun of the failed parts
(``--only``) measures them once fixed. Runs on other devices or software are refused.

    python -m bench.gpu.check_merge run1/gpu_check.json run2/gpu_check.json --out bench/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.gpu.check import RESULTS, _write, parts

SAME = ("device", "driver", "cuda", "torch", "transformers", "python")


def merge(results: list[dict], *, note: str | None = None) -> dict:
    """One result: every part from the newest run holding it, in the check's part order."""
    if not results:
        raise ValueError("nothing to merge")
    results = sorted(results, key=lambda r: r["date"])
    first = results[0]
    for r in results[1:]:
        diff = [k for k in SAME if r["device"].get(k) != first["device"].get(k)]
        if diff or r["dry_run"] != first["dry_run"]:
            raise ValueError(f"run of {r['date']} differs from the run of {first['date']} in "
                             f"{diff or ['dry_run']}: its figures do not compare")  # fmt: skip
    merged = {**results[-1], "parts": {}, "note": note,
              "runs": [{k: r[k] for k in ("commit", "date", "total_s")} for r in results]}  # fmt: skip
    merged["total_s"] = sum(r["total_s"] for r in results)
    for part in parts():
        for i in range(len(results) - 1, -1, -1):
            rec = results[i]["parts"].get(part.key)
            if rec is not None:
                merged["parts"][part.key] = {**rec, "run": i + 1}
                break
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.check_merge", description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="gpu_check.json of each run")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"default {RESULTS}")
    ap.add_argument("--note", help="a sentence for the section (what changed between runs)")
    args = ap.parse_args(argv)
    try:
        merged = merge([json.loads(p.read_text()) for p in args.runs], note=args.note)
    except (OSError, ValueError, KeyError) as e:
        print(f"gpu_check_merge: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    _write(args.out, merged)
    print(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md from {len(args.runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
