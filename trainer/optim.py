"""The student's optimizer and LR schedule, from the `optim` config section.

AdamW with weight decay on matrices only, over FSDP2's float32 shards whatever
``parallel.param_dtype`` is; a linear warmup, then cosine down to ``min_lr_ratio``. The schedule
spans ``steps`` (never ``stop_after``), so a run stopped early and resumed follows the same
curve. Clipping lives in `trainer.parallel.parallelize` (the norm is reduced over the mesh).
"""

from __future__ import annotations

import math

import torch

from trainer.config.schema import OptimConfig


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier after `step` optimizer steps: linear warmup, then cosine to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *, fused: bool) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters; `fused`: the fused kernel (one launch for every
    parameter), else torch's default (foreach where the parameters allow it)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms, biases
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=True if fused else None,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, *, steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_lambda(s, warmup=cfg.warmup_steps, total=steps, min_ratio=cfg.min_lr_ratio),
    )
