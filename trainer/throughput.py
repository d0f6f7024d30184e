"""Per-device throughput and model FLOPs utilisation (MFU) of the logged steps.

Each device's share of the step's tokens (under cp and tp a dp group's tokens are shared by its
devices), the student's and the live teachers' model FLOPs at that rate, and MFU against the
device's known peak. A model type without a FLOPs formula gets throughput only, a device without
a known peak no MFU, never a guess (docs/training.md, "Precision and throughput").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenbridge import flops, models


def peak_for(device: torch.device, *, dtype: str, tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one `device` computing in `dtype`: ``tflops`` (``logging.peak_tflops``)
    when given, else the table's (`tokenbridge.flops.peak_flops`) for a CUDA device it knows."""
    if tflops is not None:
        return tflops * 1e12
    if device.type != "cuda":
        return None
    return flops.peak_flops(torch.cuda.get_device_name(device), dtype=dtype)


@dataclass
class Throughput:
    """What a run's step records need to say how fast each device works.

    ``student``: its HF config (None: no FLOPs); ``teachers``: the live teachers' HF configs by
    KD term name; ``peak``: FLOP/s of one device (None: no MFU)."""

    world: int
    student: Any = None
    teachers: dict[str, Any] = field(default_factory=dict)
    peak: float | None = None
    _seen: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        *,
        world: int,
        student: Any,
        terms: list,
        teachers: list,
        caches: list | None,
        device: torch.device,
        dtype: str,
        peak_tflops: float | None,
    ) -> Throughput:
        """A run's: its ``student`` (HF config), the teachers (``teachers[i]``: model configs)
        of its KD ``terms`` not read from a cache (``caches[i]``), the peak of its ``device``
        at the student's compute ``dtype`` (``peak_tflops``: ``logging.peak_tflops``)."""
        caches = caches or [None] * len(teachers)
        live = {
            t.name: models.model_config(teachers[t.index]) for t in terms if caches[t.index] is None
        }
        return cls(world, student, live, peak_for(device, dtype=dtype, tflops=peak_tflops))

    def record(
        self,
        *,
        tokens: float,
        step_s: float,
        seq: float | None,
        teacher_tokens: dict[str, float] | None = None,
        teacher_seq: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """The step's per-device keys: `tokens` student tokens over every rank in `step_s`
        seconds at mean padded length `seq` (None: no FLOPs, e.g. a step whose time also went
        to sampling, whose FLOPs are not counted); `teacher_tokens` / `teacher_seq`: the same
        per live teacher."""
        # each device's share: under cp and tp a dp group's tokens are shared by its cp x tp
        # devices, each doing 1 / (cp tp) of their FLOPs (torchtitan divides by the
        # non-data-parallel size alike); the rate MFU needs
        per_device = tokens / self.world / step_s
        m = {"tokens_per_s_per_device": per_device}
        fpt = None if seq is None else flops.flops_per_token(self.student, seq=round(seq))
        if fpt is not None:
            m["tflops_per_device"] = per_device * fpt / 1e12
            achieved = flops.mfu(per_device * fpt, self.peak)
            if achieved is not None:
                m["mfu"] = achieved
        teacher = self._teacher_flops(teacher_tokens or {}, teacher_seq or {})
        if teacher is not None:
            m["teacher_tflops_per_device"] = teacher / self.world / step_s / 1e12
            achieved = flops.mfu(teacher / self.world / step_s, self.peak)
            if achieved is not None:
                m["teacher_mfu"] = achieved
        for k, v in m.items():
            self._seen.setdefault(k, []).append(v)
        return m

    def _teacher_flops(self, tokens: dict[str, float], seq: dict[str, float]) -> float | None:
        """The live teachers' forward FLOPs of the step (None when none has a formula).

        A teacher worker runs on its rank's device, so these count on the same devices. 2 N
        holds the lm_head at every teacher token, as the model's forward does; `teacher_forward`
        applies it only where the loss reads outputs, so for a teacher whose lm_head is most of
        N (Gemma 3) and a loss that reads few positions this counts more than the worker
        computes."""
        total, counted = 0.0, False
        for name, config in self.teachers.items():
            if name not in tokens or name not in seq:
                continue
            fpt = flops.flops_per_token(config, seq=round(seq[name]), training=False)
            if fpt is not None:
                total, counted = total + tokens[name] * fpt, True
        return total if counted else None

    def summary(self) -> dict[str, Any]:
        """The run summary's ``throughput``: each key's median over the logged steps, and the
        peak it was measured against (TFLOP/s, None when unknown)."""
        out: dict[str, Any] = {k: statistics.median(v) for k, v in self._seen.items()}
        out["peak_tflops"] = None if self.peak is None else self.peak / 1e12
        return out
