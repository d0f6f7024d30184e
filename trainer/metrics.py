"""Run outputs a person reads: per-step metrics (JSONL, TensorBoard), progress, the summary.

Only rank 0 writes; other ranks get a logger whose methods do nothing, so the loop calls it
unconditionally (one code path, as in nanoGPT's ``master_process`` gate). Values are plain
floats by the time they arrive here: the loop reduces tensors once per step.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

# keys shown in the tqdm postfix, in this order, when present
_POSTFIX = ("loss", "ce", "kd", "grad_norm", "lr", "tokens_per_s")


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA allocator peak on GPU, else peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


def _fmt(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return str(v)
    return f"{v:.3e}" if abs(v) < 1e-2 or abs(v) >= 1e5 else f"{v:.4g}"


class MetricsLogger:
    """JSONL + TensorBoard + tqdm for rank 0 of a run."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        jsonl: bool = True,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int = 0,
        start_step: int = 0,
        fresh: bool = True,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.tb_dir = self.run_dir / "tensorboard"
        self._jsonl = None
        self._tb = None
        self._bar = None
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
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr
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
            post = {k: _fmt(metrics[k]) for k in _POSTFIX if k in metrics}
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
    if "eval_texts" in summary:
        lines.append(
            f"(on {summary['eval_texts']} held-out windows, {summary.get('eval_bytes', 0)} bytes)"
        )
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
