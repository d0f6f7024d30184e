"""Combining KD and CE into the training loss, with the raw KD and CE always reported.

Fixed weights, or a dynamic scale stopgrad(|CE| / |KD|) on KD that must describe the whole step
(pass ``scale`` under gradient accumulation), or the loss would depend on the microbatch split.
Formulas: docs/losses.md, "Combination and several teachers".
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
