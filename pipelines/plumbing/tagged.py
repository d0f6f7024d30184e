"""Tagged outputs, dead letters and counters: how every job's DoFns report what they did.

A DoFn emits ``(tag, value)`` pairs from ``process`` (``MAIN`` for its results, ``DEAD`` for
dead-letter records) and `split` turns them into one PCollection per tag; ParDo's own
``with_outputs`` is not used because the DaskRunner mixes tagged outputs together. Every drop
is counted by reason (``dead_letter.<reason>``) and stage times go to ``stage_us.<stage>``
distributions, all in the ``tokenbridge`` metrics namespace.
"""

from __future__ import annotations

import time

import apache_beam as beam
from apache_beam.metrics import Metrics

NAMESPACE = "tokenbridge"
MAIN = "main"  # tag of a DoFn's main output
DEAD = "dead_letter"  # tag of the dead-letter outputs


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
