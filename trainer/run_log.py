"""Run outputs a person reads: per-step metrics (JSONL, TensorBoard), progress, the summary,
and the message that stops a run on a non-finite step.

Only rank 0 writes; other ranks get a logger whose methods do nothing, so the loop calls it
unconditionally (one code path, as in nanoGPT's ``master_process`` gate). Values are plain
floats by the time they arrive here: the loop keeps a step's numbers on the device, reduces
them once, and reads them in one transfer (`trainer.step`); `train_metrics` turns a shard
step's into the logged record, a pure function of those numbers and the terms' names.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# keys shown in the tqdm postfix, in this order, when present, under these labels
_POSTFIX = {
    "loss": "loss",
    "ce": "ce",
    "kd": "kd",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "tokens_per_s": "tokens_per_s",
    "tokens_per_s_per_device": "tok/s/dev",  # trainer.throughput
    "mfu": "mfu",
}


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process so far (the records' ``memory_gib``): on a GPU the CUDA
    allocator's peak (``torch.cuda.max_memory_allocated``: tensors, not the allocator's cache
    nor the teacher worker's), else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


def weighted_kd(weights: Sequence[float], kd_means: Sequence[float]) -> float:
    """The teachers' KD terms combined with their static weights (what `loss.combine` uses)."""
    return float(sum(w * v for w, v in zip(weights, kd_means)))


@dataclass
class StepNumbers:
    """One step's global numbers on the host (`read_step`)."""

    losses: list[float]  # [ce, kd_0.., total]: each term's global mean
    missed: list[float]  # per KD term: |terms counted - pre-count|, over microbatches and ranks
    counts: list[float]  # [ce, kd_0.., tokens]: the global counts the terms were divided by
    grad_norm: float
    loss_sums: dict[str, float]  # the losses' own "<teacher>/<metric>_sum" over all ranks
    source_sums: dict[str, float] = field(default_factory=dict)  # a step source's own sums


def read_step(
    shares: torch.Tensor,
    counts: torch.Tensor,
    grad_norm: torch.Tensor,
    *,
    n_terms: int,
    names: Sequence[str],
    extra: Sequence[str] = (),
) -> StepNumbers:
    """A step's one host sync: `shares` ([ce, kd_0.., total, missed_0.., then the losses' sums
    called `names`, then the step source's sums called `extra`], reduced over the dp ranks),
    `counts` and the norm in one device-to-host copy."""
    host = torch.cat([shares, counts, grad_norm.reshape(1).to(shares)]).tolist()
    k, n = 2 + n_terms, len(shares)
    named = host[k + n_terms : n]
    return StepNumbers(
        losses=host[:k],
        missed=host[k : k + n_terms],
        counts=host[n:-1],
        grad_norm=host[-1],
        loss_sums=dict(zip(names, named[: len(names)])),
        source_sums=dict(zip(extra, named[len(names) :])),
    )


def train_metrics(
    numbers: StepNumbers,
    *,
    terms: Sequence[str],
    kd_weights: Sequence[float],
    host: Mapping[str, float],
) -> dict[str, float]:
    """One step's record from its global numbers. `terms`: the teachers' names in KD-term
    order; `host`: what was measured on the host (lr, step_s, teacher_s, memory_gib, epoch,
    shm_*). The losses' own sums are logged as ``<teacher>/<metric>_mean`` per KD term."""
    losses, counts = numbers.losses, numbers.counts
    m = {"loss": losses[-1], "ce": losses[0]}
    if terms:
        kd_means = losses[1:-1]
        for name, v, c in zip(terms, kd_means, counts[1:-1]):
            m[f"kd/{name}"] = v
            # alignment coverage: KD terms (tokens or chunks) per student target token
            m[f"coverage/{name}"] = c / max(1.0, counts[0])
        m["kd"] = weighted_kd(kd_weights, kd_means)
    tokens = int(counts[-1])
    m.update(host, grad_norm=numbers.grad_norm, tokens=tokens)
    m["tokens_per_s"] = tokens / host["step_s"]
    for name, c in zip(terms, counts[1:-1]):
        for k, v in numbers.loss_sums.items():
            if k.startswith(f"{name}/") and k.endswith("_sum"):
                m[f"{k[: -len('_sum')]}_mean"] = v / max(1.0, c)
    return m


class NonFiniteError(RuntimeError):
    """A loss term or the gradient norm of a step is NaN or infinite."""


def nonfinite_terms(
    losses: Sequence[float], *, terms: Sequence[str], grad_norm: float
) -> list[str]:
    """What is not finite in a step: ``CE (nan)``, ``KD of teacher <name> (inf)``, the total
    loss when every term is finite but their combination is not, the gradient norm."""
    found = [f"CE ({losses[0]})"] if not math.isfinite(losses[0]) else []
    found += [
        f"KD of teacher {name} ({v})"
        for name, v in zip(terms, losses[1:-1])
        if not math.isfinite(v)
    ]
    if not found and not math.isfinite(losses[-1]):
        found.append(f"the combined loss ({losses[-1]})")
    if not math.isfinite(grad_norm):
        found.append(f"the gradient norm ({grad_norm})")
    return found


def nonfinite_message(step: int, found: Sequence[str], *, last_checkpoint: Path | None) -> str:
    """Why a run stops at `step`, and how to go on."""
    where = (
        f"The last good checkpoint is {last_checkpoint} (a rerun of the same command resumes "
        "from the newest one: checkpoint.resume=auto)"
        if last_checkpoint is not None
        else "No checkpoint was saved before it (checkpoint.interval=N saves every N steps)"
    )
    return (
        f"step {step}: non-finite {', '.join(found)}; the step was not applied and the run "
        f"stops. {where}. Lower optim.lr, or set optim.skip_nonfinite=true to skip such steps"
    )


def _fmt(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return str(v)
    return f"{v:.3e}" if abs(v) < 1e-2 or abs(v) >= 1e5 else f"{v:.4g}"


class MetricsLogger:
    """JSONL + TensorBoard + tqdm for rank 0 of a run; the progress bar starts at `start`
    (the step a resumed run resumes from is known once its checkpoint is loaded)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        jsonl: bool = True,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int = 0,
        fresh: bool = True,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.tb_dir = self.run_dir / "tensorboard"
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._progress, self._total_steps = enabled and progress, total_steps
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            # a fresh run starts the file over; a resumed one appends to it
            mode = "w" if fresh else "a"
            self._jsonl = open(self.jsonl_path, mode, buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.tb_dir))

    def start(self, step: int) -> None:
        """The progress bar, from optimizer step `step` (0, or the resumed one)."""
        if self._progress and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self._total_steps, initial=step, desc="train", unit="step", file=sys.stderr
            )

    def log(self, step: int, metrics: dict[str, float], *, kind: str = "train") -> None:
        """One record: a JSONL line, TensorBoard scalars under `kind/`, the progress postfix."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            rec = {"kind": kind, "step": step, "time": time.time(), **metrics}
            self._jsonl.write(json.dumps(rec, sort_keys=True) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
        if self._bar is not None and kind == "train":
            post = {label: _fmt(metrics[k]) for k, label in _POSTFIX.items() if k in metrics}
            self._bar.set_postfix(post, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def write(self, line: str) -> None:
        """A message on rank 0 that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def read_bpb(run_dir: Path, *, fresh: bool) -> dict:
    """BPB measured earlier in this run (kept across a resume, never across fresh starts)."""
    path = run_dir / "bpb.json"
    return json.loads(path.read_text()) if path.is_file() and not fresh else {}


def write_bpb(run_dir: Path, state: dict, *, enabled: bool) -> None:
    if enabled:  # whole or not at all: a reader never sees it half written
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".bpb.json.{os.getpid()}"
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, run_dir / "bpb.json")


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run summary as a few readable lines (also written as summary.json)."""
    lines = ["== tokenbridge run summary"]
    bpb = summary.get("bpb", {})
    if "student_before" in bpb:
        lines.append(f"held-out bits/byte  student before: {bpb['student_before']:.4f}")
    if "student_after" in bpb:
        delta = ""
        if "student_before" in bpb:
            delta = f"  ({bpb['student_after'] - bpb['student_before']:+.4f})"
        lines.append(f"held-out bits/byte  student after:  {bpb['student_after']:.4f}{delta}")
    for name, v in bpb.get("teachers", {}).items():
        lines.append(f"held-out bits/byte  teacher {name}: {v:.4f}")
    for when in ("before", "after"):  # on-policy: the teachers on the student's own text
        for name, v in bpb.get(f"teacher_on_student_{when}", {}).items():
            lines.append(f"teacher {name} bits/byte of student completions {when}: {v:.4f}")
    if "eval_texts" in summary:
        lines.append(
            f"(on {summary['eval_texts']} held-out windows, {summary.get('eval_bytes', 0)} bytes)"
        )
    lines += _precision_lines(summary)
    for key, label in (
        ("steps", "steps trained"),
        ("train_seconds", "train seconds"),
        ("tokens", "student tokens seen"),
        ("metrics", "metrics"),
        ("tensorboard", "tensorboard"),
        ("checkpoint", "checkpoint"),
        ("export", "exported student"),
        ("report", "run report"),
    ):
        if summary.get(key) is not None:
            lines.append(f"{label + ':':22s}{summary[key]}")
    return "\n".join(lines)


def _precision_lines(summary: dict[str, Any]) -> list[str]:
    """What the run computed in and how fast each device went (`trainer.config.precision`,
    `trainer.throughput`), when the summary says."""
    lines = []
    p = summary.get("precision")
    if p:
        teachers = ", ".join(f"{k} {v}" for k, v in p.get("teacher_dtypes", {}).items())
        lines.append(
            f"{'precision:':22s}{p['device']}: student {p['param_dtype']} (master "
            f"{p['master_dtype']}, reduce {p['reduce_dtype']}), fused AdamW "
            f"{'yes' if p['fused_optimizer'] else 'no'}"
            + (f"; teachers {teachers}" if teachers else "")
        )
    t = summary.get("throughput") or {}
    if "tokens_per_s_per_device" in t:
        parts = [f"{t['tokens_per_s_per_device']:.1f} student tokens/s per device"]
        if "tflops_per_device" in t:
            parts.append(f"{t['tflops_per_device']:.3g} TFLOP/s")
        if "mfu" in t:
            parts.append(f"MFU {t['mfu']:.1%} of {t['peak_tflops']:g} TFLOP/s")
        if "teacher_mfu" in t:
            parts.append(f"teachers' MFU {t['teacher_mfu']:.1%}")
        lines.append(f"{'throughput (median):':22s}" + ", ".join(parts))
    return lines
