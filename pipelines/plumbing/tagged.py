"""Tagged outputs, dead letters and counters: how every job's DoFns report what they did.

DoFns emit ``(tag, value)`` pairs (``MAIN``, ``DEAD``) that `split` turns into one PCollection
per tag, since the DaskRunner mixes ParDo's tagged outputs. Drops are counted by reason
(``dead_letter.<reason>``), stage times go to ``stage_us.<stage>``, both in the ``tokenbridge``
namespace. `dead_verdict` is what a finalize step asks before it writes COMPLETED
(``--max-dead-fraction``), `refuse_if_dead` what the launchers raise afterwards.
"""

from __future__ import annotations

import json
import time

import apache_beam as beam
from apache_beam.metrics import Metrics

from pipelines.plumbing import storage
from pipelines.plumbing.rolling import REFUSED

NAMESPACE = "tokenbridge"
# above this share of dead-letter rows a job fails (exit 2, no COMPLETED): a wrong field name or
# format kills most rows, a few damaged ones do not
MAX_DEAD_FRACTION = 0.5
MAIN = "main"  # tag of a DoFn's main output
DEAD = "dead_letter"  # tag of the dead-letter outputs
# a dead letter with this key set names part of an input that still gave output (not a lost one)
PARTIAL = "partial"


def count(name: str, n: int = 1) -> None:
    Metrics.counter(NAMESPACE, name).inc(n)


class StageTimer:
    """``with self._timer("tokenize"):`` adds the elapsed microseconds to ``stage_us.<name>``."""

    def __init__(self, name: str):
        self.dist = Metrics.distribution(NAMESPACE, f"stage_us.{name}")

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.dist.update(int((time.perf_counter() - self.t0) * 1e6))


def dead(record: dict) -> tuple[str, dict]:
    count(f"dead_letter.{record['reason']}")
    return DEAD, record


def select(item: tuple[str, object], tag: str) -> list:
    """FlatMap body: the value of a ``(tag, value)`` pair if it carries `tag`."""
    return [item[1]] if item[0] == tag else []


def split(pcoll, tags: list[str]) -> dict:
    """(tag, value) pairs -> one PCollection of values per tag. Used instead of ParDo's
    ``with_outputs``, whose tagged outputs the DaskRunner mixes together."""
    return {tag: pcoll | f"Select_{tag}" >> beam.FlatMap(select, tag) for tag in tags}


class TooManyDeadLetters(ValueError):
    """Most of a job's input went to the dead letters; the message names the top reasons."""


def dead_verdict(good: int, dead: dict[str, int], *, max_fraction: float, unit: str) -> str | None:
    """None when a run with `good` rows and `dead` lost ones (by reason: dead letters of inputs
    that gave no output, `writers.SummaryCombineFn`'s ``lost``) may complete; else why not, in
    one line: the share, the limit, and the three commonest reasons."""
    n_dead = sum(dead.values())
    total = good + n_dead
    if n_dead == 0 or (good > 0 and n_dead / total <= max_fraction):
        return None
    top = sorted(dead.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    reasons = ", ".join(f"{reason} {n}" for reason, n in top)
    why = "every one" if good == 0 else f"{n_dead / total:.0%} > --max-dead-fraction {max_fraction}"
    return f"{n_dead} of {total} {unit} went to the dead letters ({why}); top reasons: {reasons}"


def refuse_if_dead(stats_file) -> None:
    """Raise `TooManyDeadLetters` if the finalize step refused the run (its stats.json says so)."""
    if not storage.exists(stats_file):
        return
    if why := json.loads(storage.read_bytes(stats_file)).get(REFUSED):
        parent = str(stats_file).rsplit("/", 1)[0]
        raise TooManyDeadLetters(
            f"{parent}: {why}; no COMPLETED written (see {parent}/dead_letter.jsonl)"
        )


def add_dead_fraction_arg(ap) -> None:
    """Every job's ``--max-dead-fraction`` (read back with `dead_fraction`)."""
    ap.add_argument(
        "--max-dead-fraction",
        type=float,
        default=MAX_DEAD_FRACTION,
        help="fail (exit 2, no COMPLETED) when more than this share of the input is dead-lettered "
        f"(default {MAX_DEAD_FRACTION}: a wrong field name or format kills most rows, a few "
        "damaged rows do not); a run where every row died always fails",
    )


def dead_fraction(args) -> float:
    """The parsed ``--max-dead-fraction``, refused unless a share in [0, 1]."""
    x = args.max_dead_fraction
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"--max-dead-fraction {x}: expected a share in [0, 1]")
    return x
