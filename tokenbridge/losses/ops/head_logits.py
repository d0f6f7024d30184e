"""Logits that are never whole: the lm_head's input and weight, projected a block of rows at a time.

Every loss reads the logits row by row through `rowwise.map_rows` and `fused`'s two reductions,
so a `HeadLogits` can stand in for the [N, V] tensor: each projects only the rows it selects and
writes its gradient into the hidden states and the weight. Why and what it costs:
docs/parallelism.md, "Logits never whole".

Legend: N rows (positions), H hidden size, V vocabulary (this rank's shard), r selected rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class HeadLogits:
    """The logits ``softcap(hidden @ weight.T)`` of shape ``lead + (V,)``, computed per block.

    ``hidden``: [..., H] (any leading shape: [B, L, H] as the model returns it, [N, H] once
    flattened); ``weight``: [V, H]; ``softcap``: the model's final-logit soft-capping (Gemma 2)
    or None; ``chunk``: rows per block, overriding a loss's own ``chunk_size`` (the config's
    ``parallel.logits_chunk``)."""

    hidden: Tensor
    weight: Tensor
    softcap: float | None = None
    chunk: int = 256
    # the leading shape of ``hidden``, or None: the gradient that reaches each row's logits is
    # multiplied by its value (importance weights, `trainer.onpolicy.importance`); the values
    # are unchanged
    row_scale: Tensor | None = None

    def __post_init__(self) -> None:
        if self.hidden.shape[-1] != self.weight.shape[-1]:
            raise ValueError(
                f"HeadLogits: hidden {tuple(self.hidden.shape)} and weight "
                f"{tuple(self.weight.shape)} disagree on the hidden size"
            )
        if self.chunk < 1:
            raise ValueError(f"HeadLogits: chunk must be >= 1, got {self.chunk}")
        if self.row_scale is not None and self.row_scale.shape != self.hidden.shape[:-1]:
            raise ValueError(
                f"HeadLogits: row_scale {tuple(self.row_scale.shape)} is not the rows' shape "
                f"{tuple(self.hidden.shape[:-1])}"
            )

    # the few tensor attributes the losses read
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.promote_types(self.hidden.dtype, self.weight.dtype)

    @property
    def requires_grad(self) -> bool:
        return self.hidden.requires_grad or self.weight.requires_grad

    def reshape(self, *shape: int) -> HeadLogits:
        """A view with other leading dims; the last one must stay V (as every loss flattens)."""
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if shape[-1] not in (self.weight.shape[0], -1) or len(shape) < 2:
            raise ValueError(f"HeadLogits: reshape {shape} must keep the vocabulary last")
        hidden = self.hidden.reshape(*shape[:-1], self.hidden.shape[-1])
        scale = None if self.row_scale is None else self.row_scale.reshape(hidden.shape[:-1])
        return HeadLogits(hidden, self.weight, self.softcap, self.chunk, scale)

    def detach(self) -> HeadLogits:
        return HeadLogits(
            self.hidden.detach(), self.weight.detach(), self.softcap, self.chunk, self.row_scale
        )

    def zero_sum(self) -> Tensor:
        """A 0-dim zero connected to the graph (`base.zero_sum_like`)."""
        return self.hidden.reshape(-1)[:0].sum() + self.weight.reshape(-1)[:0].sum()


def project(hidden_rH: Tensor, weight_VH: Tensor, *, softcap: float | None) -> Tensor:
    """``softcap(hidden @ weight.T)``: what the lm_head (and the model's capping) computes."""
    x = hidden_rH @ weight_VH.t()
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    return x


def project_backward(
    grad_rV: Tensor, hidden_rH: Tensor, weight_VH: Tensor, logits_rV: Tensor | None, *,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(d hidden [r, H], d weight [V, H]) from the gradient of the projected rows. With
    soft-capping, ``logits_rV`` are the capped values (d tanh = 1 - (x / cap)^2)."""
    if softcap is not None:
        grad_rV = grad_rV * (1 - (logits_rV / softcap).square())
    grad_rV = grad_rV.to(weight_VH.dtype)
    return grad_rV @ weight_VH, grad_rV.t() @ hidden_rH


class ScaleGrad(torch.autograd.Function):
    """``x`` unchanged forward; backward, each row's gradient times ``scale_r`` (a copy: a
    Function may not return its input as is)."""

    @staticmethod
    def forward(ctx, x_rV: Tensor, scale_r: Tensor) -> Tensor:
        ctx.save_for_backward(scale_r)
        return x_rV.clone()

    @staticmethod
    def backward(ctx, g_rV: Tensor):
        (scale_r,) = ctx.saved_tensors
        return g_rV * scale_r.to(g_rV.dtype)[:, None], None
