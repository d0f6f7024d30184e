"""The writers every job shares: rolling part files per bundle, the dead letters, and the one
summary element the finalize step reads.

A dead letter stands for an input lost (no output) or, with ``"partial": true``, for part of
one that still gave output; both are counted by reason, the lost ones also apart (``lost``),
which is what ``--max-dead-fraction`` compares with a job's output.
"""

from __future__ import annotations

from collections import Counter

import apache_beam as beam
import numpy as np

from pipelines.plumbing import rolling
from pipelines.plumbing.tagged import PARTIAL


class RollingPartsDoFn(beam.DoFn):
    """A writer of this bundle's rolling parts (`rolling.RollingParts` of ``KIND`` / ``FMT``):
    opened per bundle, closed at its end, thrown away if the worker is torn down mid-bundle.
    The parts' records go out from ``process``: Dask drops what ``finish_bundle`` yields."""

    KIND, FMT = "", ""

    def __init__(self, tmp_dir: str, *, roll_bytes: int):
        self.tmp_dir, self.roll_bytes = tmp_dir, roll_bytes
        self.parts: rolling.RollingParts | None = None

    def start_bundle(self):
        self.parts = rolling.RollingParts(
            self.tmp_dir, kind=self.KIND, fmt=self.FMT, roll_bytes=self.roll_bytes
        )

    def finish_bundle(self):
        self.parts.close()

    def teardown(self):
        if self.parts is not None:
            self.parts.abort()


class WriteDeadLettersDoFn(RollingPartsDoFn):
    """Dead-letter records -> this bundle's rolling jsonl parts; -> ("dead", part, reason,
    partial)."""

    KIND, FMT = "dead", "jsonl"

    def process(self, record: dict):
        partial = bool(record.get(PARTIAL, False))
        yield ("dead", self.parts.write([record]), record["reason"], partial)


def _add(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return None if b is None else np.array(b, np.int64)
    if b is not None:
        a += b
    return a


class SummaryCombineFn(beam.CombineFn):
    """Everything the final step needs, in one element: parts with their rows and first key,
    dead-letter parts, the summed statistics vector, dead letters by reason (all, and only
    those of lost inputs)."""

    def create_accumulator(self):
        return {
            "parts": {},
            "dead_parts": Counter(),
            "stats": None,
            "dead": Counter(),
            "lost": Counter(),
        }

    def add_input(self, acc, item):
        tag = item[0]
        if tag == "part":
            _, name, rows, key, stats = item
            part = acc["parts"].setdefault(name, {"rows": 0, "key": key})
            part["rows"] += rows
            part["key"] = min(part["key"], key)
            acc["stats"] = _add(acc["stats"], stats)
        elif tag == "stats":
            acc["stats"] = _add(acc["stats"], item[1])
        else:
            _, part, reason, partial = item
            acc["dead_parts"][part] += 1
            acc["dead"][reason] += 1
            if not partial:
                acc["lost"][reason] += 1
        return acc

    def merge_accumulators(self, accs):
        out = self.create_accumulator()
        for a in accs:
            for name, p in a["parts"].items():
                q = out["parts"].setdefault(name, {"rows": 0, "key": p["key"]})
                q["rows"] += p["rows"]
                q["key"] = min(q["key"], p["key"])
            out["dead_parts"].update(a["dead_parts"])
            out["dead"].update(a["dead"])
            out["lost"].update(a["lost"])
            out["stats"] = _add(out["stats"], a["stats"])
        return out

    def extract_output(self, acc):
        return acc
