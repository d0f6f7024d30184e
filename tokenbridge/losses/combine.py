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

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tokenbridge.losses.base import check_option

COMBINE_MODES = ("fixed", "dynamic")


@dataclass(frozen=True)
class CombineConfig:
    """How KD and CE make the loss; the one definition of these options and their checks (the
    trainer's ``loss`` section builds it from ``loss.combine``, ``loss.kd_weight`` and
    ``loss.ce_weight``). An invalid value raises `OptionError` naming the field."""

    mode: str = "fixed"  # fixed | dynamic
    kd_weight: float = 1.0  # fixed mode: lambda_kd
    ce_weight: float = 1.0  # lambda_ce (fixed mode; also the CE-only loss)
    eps: float = 1e-8  # dynamic mode: |KD| floor

    def __post_init__(self) -> None:
        check_option(self, "mode", self.mode in COMBINE_MODES, f"one of {list(COMBINE_MODES)}")
        for name in ("kd_weight", "ce_weight"):
            w = getattr(self, name)
            check_option(self, name, math.isfinite(w) and w >= 0, "a non-negative number")
        check_option(self, "eps", math.isfinite(self.eps) and self.eps > 0, "a positive number")


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
