"""Several teachers, each with its own tokenizer, alignment and projection: a weighted sum.

Each teacher's KD is normalised by its own global count, then mixed with static or adaptive
weights (from each teacher's NLL of the same text per common unit). Formulas and why:
docs/losses.md, "Combination and several teachers".

Legend: K teachers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tokenbridge.losses.base import as_count
from tokenbridge.losses.ops.segments import ChunkIndex
from tokenbridge.teacher.outputs import TeacherOutputs


@dataclass(frozen=True)
class MultiTeacherConfig:
    weights: tuple[float, ...] | None = None  # static weights (normalised); None = uniform
    adaptive: bool = False  # softmax(-nll_per_unit / temperature) instead
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.weights is not None and (
            not self.weights or any(w < 0 for w in self.weights) or sum(self.weights) <= 0
        ):
            raise ValueError(
                f"MultiTeacherConfig.weights must be >= 0 with a positive sum: {self.weights}"
            )
        if self.temperature <= 0:
            raise ValueError("MultiTeacherConfig.temperature must be > 0")


def teacher_nll(teacher: TeacherOutputs, index: ChunkIndex) -> tuple[Tensor, Tensor]:
    """(sum of -log p over the teacher's chunk tokens, number of those tokens), no grad."""
    teacher.require(("target_logprob",), mode="multi_teacher")
    rows = index.teacher.target_chunk >= 0
    if index.select is not None:  # conversations: the trained chunks only
        rows = rows & index.select[index.teacher.target_chunk.clamp(min=0)]
    lp = teacher.target_logprob.reshape(-1)[rows].detach().double()
    return -lp.sum(), as_count(int(rows.sum()), lp.device)


def static_weights(n_teachers: int, weights: Sequence[float] | None = None) -> Tensor:
    w = (
        torch.ones(n_teachers, dtype=torch.float64)
        if weights is None
        else torch.tensor(weights, dtype=torch.float64)
    )
    if w.numel() != n_teachers:
        raise ValueError(f"{w.numel()} teacher weights for {n_teachers} teachers")
    return w / w.sum()


def adaptive_weights(
    nll_sums_K: Tensor, units: Tensor | float, *, temperature: float = 1.0
) -> Tensor:
    """softmax_i(-(nll_i / units) / temperature): lower NLL on the same text, larger weight."""
    per_unit = torch.as_tensor(nll_sums_K, dtype=torch.float64) / torch.as_tensor(
        units, dtype=torch.float64
    ).clamp(min=1)
    return torch.softmax(-per_unit / temperature, dim=0)


def teacher_weights(
    config: MultiTeacherConfig,
    n_teachers: int,
    *,
    nll_sums_K: Tensor | None = None,
    units: Tensor | float | None = None,
) -> Tensor:
    if not config.adaptive:
        return static_weights(n_teachers, config.weights)
    if nll_sums_K is None or units is None:
        raise ValueError("adaptive teacher weights need nll_sums_K and units")
    return adaptive_weights(nll_sums_K, units, temperature=config.temperature)


def combine_teachers(
    kd_values_K: Sequence[Tensor], weights_K: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """(sum_i w_i * kd_i, metrics with every kd_i and w_i). kd_i are already normalised."""
    if len(kd_values_K) != weights_K.numel():
        raise ValueError(f"{len(kd_values_K)} teacher losses for {weights_K.numel()} weights")
    total = sum(w.to(kd.dtype) * kd for w, kd in zip(weights_K, kd_values_K))
    metrics: dict[str, Tensor] = {}
    for i, (w, kd) in enumerate(zip(weights_K, kd_values_K)):
        metrics[f"teacher{i}/kd"] = kd.detach()
        metrics[f"teacher{i}/weight"] = w.detach().float()
    metrics["kd"] = total.detach()
    return total, metrics
