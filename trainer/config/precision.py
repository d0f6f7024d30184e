"""The run's precision, resolved once for its device: dtypes of the student and teachers, and
whether the optimizer uses the fused AdamW kernel.

``auto`` (the default) becomes what this device uses through the library's one rule
(`tokenbridge.model_spec.resolve_dtype`), and the preflight hands the result to everything that
needs it, so no two places decide it (docs/training.md, "Precision and throughput"). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenbridge.model_spec import resolve_dtype
from trainer.config.schema import TrainConfig


@dataclass(frozen=True)
class Precision:
    """What a run computes in, on its device (every dtype a concrete name, never auto)."""

    device: str  # the device type: cuda or cpu
    param_dtype: str  # the student's compute copies (FSDP2 MixedPrecisionPolicy.param_dtype)
    reduce_dtype: str  # its gradient reduction
    teacher_dtypes: tuple[str, ...]  # per teacher (teachers[i]), weights and compute
    fused_optimizer: bool  # AdamW's fused kernel (else the foreach implementation)

    def summary(self, teacher_names: list[str]) -> dict:
        """The run summary's ``precision`` entry: what was used, by name."""
        return {
            "device": self.device,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
            "master_dtype": "float32",  # FSDP2's sharded parameters and the AdamW moments
            "teacher_dtypes": dict(zip(teacher_names, self.teacher_dtypes)),
            "fused_optimizer": self.fused_optimizer,
        }


def resolve_fused(value: bool | str, device: str) -> bool:
    """``optim.fused``: auto = the fused kernel (on CUDA and on CPU: one pass over each
    parameter's state; on a 2-core EPYC 0.07 s against foreach's 0.55 s for SmolLM2-135M's
    parameters, one thread; HF Trainer's default too); true / false as named."""
    return device in ("cuda", "cpu") if value == "auto" else bool(value)


def resolve_precision(cfg: TrainConfig, *, device: str) -> Precision:
    """`cfg`'s dtypes and optimizer kernel on a `device` of this type (``cuda`` or ``cpu``)."""
    return Precision(
        device=device,
        param_dtype=resolve_dtype(cfg.parallel.param_dtype, device),
        reduce_dtype=resolve_dtype(cfg.parallel.reduce_dtype, device),
        teacher_dtypes=tuple(resolve_dtype(t.dtype, device) for t in cfg.teachers),
        fused_optimizer=resolve_fused(cfg.optim.fused, device),
    )
