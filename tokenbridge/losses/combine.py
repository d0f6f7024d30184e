"""Combining KD and CE into the training loss, with both terms always reported.

Each term comes normalised by `tokenbridge.losses.base.normalize` (local sum / global count):

    kd = normalize(kd_out, kd_count_global)        ce = normalize(ce_out, ce_count_global)
    fixed:    loss = lambda_kd * kd + lambda_ce * ce
    dynamic:  loss = stopgrad(|CE| / |KD|) * kd + ce

Summing ``loss`` over the microbatches of a step (backward on each) then gives exactly the loss
and gradients of the whole global batch, however it is split.

The dynamic scale needs |CE| and |KD| of the whole step. With one microbatch per step and the
values all-reduced, ``scale=None`` computes it from the values passed in. With gradient
accumulation the step's totals are not known before the first backward, so pass ``scale``
explicitly, e.g. the ratio of the previous step's global means (`dynamic_scale`); computing it
per microbatch would make the loss depend on the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CombineConfig:
    mode: str = "fixed"  # fixed | dynamic
    kd_weight: float = 1.0  # fixed mode
    ce_weight: float = 1.0  # fixed mode
    eps: float = 1e-8  # dynamic mode: |KD| floor

    def __post_init__(self) -> None:
        if self.mode not in ("fixed", "dynamic"):
            raise ValueError(f"CombineConfig.mode must be 'fixed' or 'dynamic', got {self.mode!r}")
        if self.kd_weight < 0 or self.ce_weight < 0:
            raise ValueError("CombineConfig weights must be >= 0")


def dynamic_scale(
    ce_value: Tensor | float, kd_value: Tensor | float, *, eps: float = 1e-8
) -> Tensor:
    """stopgrad(|CE| / |KD|), the factor that brings KD to CE's magnitude."""
    ce_v = torch.as_tensor(ce_value).detach().abs()
    kd_v = torch.as_tensor(kd_value).detach().abs()
    return ce_v / kd_v.clamp(min=eps)


def combine(
    kd: Tensor, ce: Tensor, *, config: CombineConfig, scale: Tensor | float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, metrics) from the normalised KD and CE terms. Metrics: kd, ce, kd_scale, loss."""
    if config.mode == "fixed":
        loss = config.kd_weight * kd + config.ce_weight * ce
        kd_scale = torch.as_tensor(config.kd_weight)
    else:
        kd_scale = (
            dynamic_scale(ce, kd, eps=config.eps) if scale is None else torch.as_tensor(scale)
        )
        kd_scale = kd_scale.detach().to(kd.dtype)
        loss = kd_scale * kd + ce
    metrics = {
        "kd": kd.detach(),
        "ce": ce.detach(),
        "kd_scale": kd_scale.detach(),
        "loss": loss.detach(),
    }
    return loss, metrics
