"""`make bench BENCH=science`: the science table (issue 16) as a BENCHMARKS.md section.

Runs ``bench.science`` with its defaults (resumable: finished runs under runs/science are
read back, not re-run) and wraps its table with the machine and the budget. About an hour and
a half of CPU on 2 cores from nothing; docs/science.md explains the rows and the choices.
"""

from __future__ import annotations

import json
import subprocess

from bench import science


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "?")


def main() -> str:
    science.main([])
    out = science.REPO / "runs" / "science"
    payload = json.loads((out / "results.json").read_text())
    table = (out / "science.md").read_text()
    return (
        "## The science table: every loss mode vs CE-only vs TRL's GOLD loss (issue 16)\n\n"
        f"{cpu_model()}, 2 cores, CPU only. Student SmolLM2-135M, teacher Gemma-3-270M, the "
        f"KJV New Testament letters (whole chapters held out), {payload['steps']} steps of one "
        f"256-token window, AdamW lr {payload['lr']:g}, seeds {payload['seeds']}; eval suite "
        f"LIMIT {payload['limit']} (first seed), out-of-domain text `{payload['ood_text']}` "
        f"({payload['ood_limit']} chunks). Mean ± standard error over seeds; the suite cells "
        "carry the eval's own standard error over examples. docs/science.md explains it.\n\n"
        + table
        + f"\n_(table took {payload['seconds'] / 60:.0f} min, resumed pieces excluded)_\n"
    )
