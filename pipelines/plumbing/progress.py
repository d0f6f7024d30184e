"""Progress of a running job, on every runner: workers write counts, the launcher prints them.

Runners report metrics only when a stage ends (here, the end of the run; Dask never), so each
worker process adds its counts to a small JSON file of its own (`ProgressSink`) and the launcher
sums the files and prints one line on stderr (`ProgressReporter`):

    align: 23.4/110.0 MB (21%), 98,012 documents, 1.21M tokens/s, ETA 1m10s

Best effort: a file that cannot be written or read is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from tokenbridge import atomic

FLUSH_S = 2.0
_SINKS: dict[str, ProgressSink] = {}
_SINKS_LOCK = threading.Lock()


class ProgressSink:
    """The counts of one worker process for one run (shared by its DoFns via `sink_for`)."""

    def __init__(self, directory: str):
        self.path = Path(directory) / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        self.counts = {"bytes": 0, "documents": 0, "tokens": 0}
        self.lock = threading.Lock()
        self.flushed = 0.0

    def add(self, *, bytes: int = 0, documents: int = 0, tokens: int = 0) -> None:
        with self.lock:
            self.counts["bytes"] += int(bytes)
            self.counts["documents"] += int(documents)
            self.counts["tokens"] += int(tokens)
            due = time.monotonic() - self.flushed >= FLUSH_S
        if due:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            data = json.dumps(self.counts)
            self.flushed = time.monotonic()
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write(self.path, data, fsync=False, tmp=tmp)


def sink_for(directory: str | None) -> ProgressSink | None:
    """This process's sink for a run's progress directory (None: progress off)."""
    if not directory:
        return None
    with _SINKS_LOCK:
        if directory not in _SINKS:
            _SINKS[directory] = ProgressSink(directory)
        return _SINKS[directory]


def read_totals(directory: str | os.PathLike) -> dict:
    totals = {"bytes": 0, "documents": 0, "tokens": 0}
    for p in Path(directory).glob("*.json"):
        try:
            counts = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        for k in totals:
            totals[k] += int(counts.get(k, 0))
    return totals


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def progress_line(totals: dict, *, total_bytes: int, elapsed: float) -> str:
    done = min(totals["bytes"], total_bytes)
    frac = done / total_bytes if total_bytes else 0.0
    rate = totals["tokens"] / elapsed if elapsed > 0 else 0.0
    eta = _duration(elapsed * (1 - frac) / frac) if frac > 0 else "?"
    return (
        f"align: {done / 1e6:.1f}/{total_bytes / 1e6:.1f} MB ({frac:.0%}), "
        f"{totals['documents']:,} documents, {rate / 1e6:.2f}M tokens/s, ETA {eta}"
    )


class ProgressReporter:
    """A daemon thread printing the summed worker counts every `interval` seconds.

    ``with ProgressReporter(dir, total_bytes=...):`` around the run; nothing is printed for a
    run shorter than one interval. ``line(totals, elapsed=...)`` words the line (default: the
    align job's, `progress_line`) and ``label`` names the bar; another job counts its own units
    in the same three fields (the teacher cache: teacher tokens as "bytes", rows as
    "documents").
    """

    def __init__(
        self,
        directory,
        *,
        total_bytes: int,
        interval: float = 10.0,
        stream=None,
        label: str = "align",
        line=None,
    ):
        self.directory, self.total_bytes, self.interval = Path(directory), total_bytes, interval
        self.line = line or functools.partial(progress_line, total_bytes=total_bytes)
        self.stream = stream or sys.stderr
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.totals: dict = {}
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(
                    total=total_bytes, unit="B", unit_scale=True, desc=label, file=self.stream
                )
        self.thread = threading.Thread(target=self._loop, name=f"{label}-progress", daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(self.interval):
            self.report()

    def report(self) -> str:
        # never backwards: the finalize step removes the directory at the end
        new = read_totals(self.directory)
        totals = self.totals = {k: max(v, self.totals.get(k, 0)) for k, v in new.items()}
        line = self.line(totals, elapsed=time.monotonic() - self.t0)
        if self.bar is not None:
            self.bar.n = min(totals["bytes"], self.total_bytes)
            self.bar.set_postfix_str(line.split(", ", 1)[1], refresh=True)
        else:
            print(line, file=self.stream, flush=True)
        return line

    def __enter__(self) -> ProgressReporter:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        if self.bar is not None:
            self.bar.close()


def run_with_progress(pipeline, directory, **reporter):
    """Run a Beam pipeline to the end under a `ProgressReporter` (``reporter``: its keyword
    arguments), closing the client a DaskRunner opens for itself; returns the result."""
    with ProgressReporter(directory, **reporter):
        result = pipeline.run()
        try:
            result.wait_until_finish()
        finally:
            client = getattr(result, "client", None)
            if client is not None:
                client.close()
    return result
