"""`make bench BENCH=science`: the science table (issue 16) as a BENCHMARKS.md section.

Runs ``bench.science`` with its defaults (resumable: finished runs under runs/science are
read back, not re-run) and wraps its table with the machine and the budget. About an hour and
a half of CPU on 2 cores from nothing; docs/science.md explains the rows and the choices.
"""

from __future__ import annotations

import json

from bench import science
from bench.provenance import cpu_model

NOTES = """
- Train seconds: two cached/CE runs shared the 2 cores (one thread each); the live rows ran
  with the student on one core and the teacher worker on the other; some rows overlapped the
  test suite, so compare seconds within a row's seeds, not across rows.
- The cache row equals the live one: `make demo`'s live xtoken + CE run (same config, seed 0)
  ended at 1.100998176 bits/byte, the cached xtoken row's seed 0 at 1.100998169.
"""


def main() -> str:
    science.main([])
    return section(science.REPO / "runs" / "science")


def section(out) -> str:
    """The BENCHMARKS.md section of the table in `out` (results.json + science.md)."""
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
        + NOTES
    )
