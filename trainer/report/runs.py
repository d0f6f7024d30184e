"""A run folder as the report reads it: metrics.jsonl series, bpb.json, summary.json, shard stats.

Every file is optional (a killed run's last line may be cut mid-write): the report shows what
is there and lists what is not. A resumed run re-logs steps, and the last record of a step wins
(docs/eval.md, "The run report").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from trainer.eval.results import model_names

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
BPB_FILE = "bpb.json"
STATS_FILE = "stats.json"


@dataclass
class Series:
    """One metric over optimizer steps (steps ascending, one value per step)."""

    steps: list[int]
    values: list[float]

    def __len__(self) -> int:
        return len(self.steps)

    def last(self) -> float | None:
        return self.values[-1] if self.values else None


@dataclass
class Run:
    """What one run folder holds, as plain series and dicts (empty where a file is missing)."""

    name: str
    path: Path
    train: dict[str, Series] = field(default_factory=dict)
    eval: dict[str, Series] = field(default_factory=dict)
    bpb: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    shards: str | None = None
    shard_stats: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def teachers(self) -> list[str]:
        """Teacher names in config order where the summary recorded it, else as logged."""
        logged = sorted(k[len("kd/") :] for k in self.train if k.startswith("kd/"))
        named = [t for t in self.summary.get("teachers", []) if t in logged]
        return named + [t for t in logged if t not in named]

    def teacher_bpb(self) -> dict[str, float]:
        """Each teacher's held-out bits/byte: bpb.json, else the eval records (`bpb/<name>`)."""
        out = {k[len("bpb/") :]: s.last() for k, s in self.eval.items() if k.startswith("bpb/")}
        out.update(self.bpb.get("teachers", {}))
        return {k: float(v) for k, v in out.items() if v is not None}

    def student_bpb(self) -> Series:
        """The student's held-out bits/byte over steps: the eval records, plus bpb.json's
        before/after where the records lack them (a run logged with jsonl off)."""
        points = (
            dict(zip(self.eval["bpb"].steps, self.eval["bpb"].values)) if "bpb" in self.eval else {}
        )
        if "student_before" in self.bpb:
            points.setdefault(0, float(self.bpb["student_before"]))
        if "student_after" in self.bpb and "steps" in self.summary:
            points.setdefault(int(self.summary["steps"]), float(self.bpb["student_after"]))
        steps = sorted(points)
        return Series(steps, [points[s] for s in steps])


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_metrics(path: Path) -> tuple[dict[str, dict[int, dict]], int]:
    """``{kind: {step: merged record}}`` and the number of lines that were not JSON records
    (a line cut by a kill, or garbage); later records of a step override earlier ones key by
    key, so an eval step's several records (student, teachers) merge into one."""
    by_kind: dict[str, dict[int, dict]] = {}
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step = int(rec["step"])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            by_kind.setdefault(str(rec.get("kind", "train")), {}).setdefault(step, {}).update(rec)
    return by_kind, bad


def to_series(records: dict[int, dict]) -> dict[str, Series]:
    """Per-step records -> one `Series` per numeric key (a key absent at a step is skipped)."""
    out: dict[str, Series] = {}
    for step in sorted(records):
        for key, value in records[step].items():
            if key in ("step", "time", "kind") or not _number(value):
                continue
            s = out.setdefault(key, Series([], []))
            s.steps.append(step)
            s.values.append(float(value))
    return out


def _read_json(path: Path, notes: list[str]) -> dict:
    if not path.is_file():
        notes.append(f"no {path.name}")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        notes.append(f"{path.name} unreadable ({e})")
        return {}


def load_run(path: str | Path, *, name: str | None = None) -> Run:
    """Read a run folder; raises FileNotFoundError only when it holds none of the run files."""
    path = Path(path)
    files = (METRICS_FILE, SUMMARY_FILE, BPB_FILE)
    if not path.is_dir() or not any((path / f).is_file() for f in files):
        raise FileNotFoundError(
            f"{path}: not a run folder (expected {', '.join(files)} from trainer/main.py)"
        )
    run = Run(name=name or path.name, path=path)
    metrics = path / METRICS_FILE
    if metrics.is_file():
        by_kind, bad = read_metrics(metrics)
        run.train = to_series(by_kind.get("train", {}))
        run.eval = to_series(by_kind.get("eval", {}))
        if bad:
            run.notes.append(f"{bad} unreadable line(s) in {METRICS_FILE} skipped")
    else:
        run.notes.append(f"no {METRICS_FILE}")
    run.summary = _read_json(path / SUMMARY_FILE, run.notes)
    run.bpb = _read_json(path / BPB_FILE, run.notes)
    run.shards = run.summary.get("shards")
    if run.shards:
        stats = Path(run.shards) / STATS_FILE
        if stats.is_file():
            run.shard_stats = _read_json(stats, run.notes)
        else:
            run.notes.append(f"shard stats {stats} not found")
    elif run.summary:
        run.notes.append("shard folder not recorded in summary.json")
    return run


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Several run folders, named by the shortest path suffixes that tell them apart."""
    names = model_names([str(p) for p in paths])
    return [load_run(p, name=n) for p, n in zip(paths, names)]


def finite(values: list[float]) -> list[float | None]:
    """JSON-safe values (NaN and infinities as null)."""
    return [v if math.isfinite(v) else None for v in values]
