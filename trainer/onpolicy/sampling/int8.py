"""An int8 copy of the student's projections for sampling on CPU (``onpolicy.sampler_weights:
int8``).

A decode step at a few live rows is bound by reading the weights; fbgemm's dynamic-quantized
linear (int8 weights with a scale per row, activations quantized per call) reads a quarter of
fp32's bytes and reaches the memory bandwidth where fp32's skinny products do not. Its
distribution is not the trained model's, so the step weights each position by its likelihood
ratio (`trainer.onpolicy.importance`; docs/onpolicy.md, "Sampling from an int8 copy").
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

# activations quantized to 7 bits: fbgemm's choice for x86 without VNNI, where 8-bit products
# can saturate its 16-bit accumulations; the ratio-weighted loss corrects the difference
REDUCE_RANGE = True
BLOCK_ROWS = 4096  # rows quantized at a time (16 MB of float32 at SmolLM2's width)


def int8_available() -> bool:
    """Can this torch build run fbgemm's dynamic int8 linear (x86 CPU builds can)? torch marks
    these quantized ops deprecated (for torchao)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_dynamic"
    )


class Int8Linear:
    """``x @ cat(weights).T + bias`` through one packed int8 matrix (per-row scales).

    Measured on the 2-core AMD EPYC (Zen 4), one thread, two rows, another job on the other
    core: SmolLM2-135M's q/k/v product 23 us vs 128 us fp32 weight-major, gate/up 42 vs 342 us,
    the 49k-row lm_head 0.97 vs 5.6 ms; outputs within ~1.5% of fp32's (max relative). The
    activations are quantized per call, over the live rows together, so a row's draws depend
    on the rows beside it (still seeded and reproducible for the same batch)."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None):
        rows = [w.detach() for w in weights]
        n, k = sum(len(w) for w in rows), rows[0].shape[1]
        scale = torch.empty(n)
        q8 = torch.empty((n, k), dtype=torch.int8)
        # rounded here, not by torch.quantize_per_channel (3x slower at one thread), a block of
        # rows at a time: no float copy of a whole matrix (the lm_head's is 113 MB)
        at = 0
        for w in rows:
            for blk in w.split(BLOCK_ROWS):
                b = blk.float()
                s = torch.maximum(b.amax(1), -b.amin(1)).div_(127).clamp_(min=1e-12)
                scale[at : at + len(b)] = s
                q8[at : at + len(b)] = b.div(s[:, None]).round_().clamp_(-127, 127)
                at += len(b)
        zero = torch.zeros(n, dtype=torch.long)
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated
            warnings.simplefilter("ignore", UserWarning)
            q = torch._make_per_channel_quantized_tensor(q8, scale.double(), zero, 0)
        b = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(q, b)

    def __call__(self, x_BK: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x_BK.float().contiguous(), self.packed, REDUCE_RANGE)
        return y.to(x_BK.dtype)


class Int8Weights:
    """`Int8Linear`s of a list of (weights, bias) groups (`decode.projection_groups`), made on
    ``threads`` threads (fbgemm packs each matrix on one: ~1 s for SmolLM2-135M's on one core)."""

    def __init__(self, groups: list, *, threads: int | None = None):
        n = threads or torch.get_num_threads()
        with torch.no_grad(), ThreadPoolExecutor(max(1, n)) as pool:
            self.linears = list(pool.map(lambda g: Int8Linear(*g), groups))
