"""Which of two equal forms a decode step's skinny products take on this machine, measured once.

A decode step multiplies a few live rows by every weight, ``x [B, K] @ W.T``: little arithmetic
per byte read, so its time is how close the BLAS library gets to the memory bandwidth, and that
depends on the library, the CPU and the form of the product. So neither form is assumed: each
process times both over the model's own weights (`tune`) and keeps the faster; a checkpoint
keeps what was measured (`saved`, `restore`).

Legend: B rows, K input width, N output width (the products' weights side by side).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

MAX_TUNED_ROWS = 8  # past this many rows F.linear was as fast as the other form on both CPUs
REPS = 3  # timed passes per form (the least counts; the first also warms up)

# (rows, N, K, dtype, threads) -> True where the weight-major form was measured faster
_CHOICE: dict[tuple, bool] = {}


def shape(weights: list[torch.Tensor]) -> tuple:
    """(N, K, dtype) of a product's weights side by side: what its measured form is kept by."""
    return sum(w.shape[0] for w in weights), weights[0].shape[1], weights[0].dtype


def weight_major(rows: int, shape_: tuple) -> bool:
    """The form this machine measured faster for ``rows`` rows through weights of ``shape_``
    (`shape`) at torch's current threads (False, ``F.linear``, where not measured: `tune`)."""
    return _CHOICE.get((rows, *shape_, torch.get_num_threads()), False)


def project(
    x_BK: torch.Tensor, weights: list, bias_N: torch.Tensor | None, *, major: bool
) -> torch.Tensor:
    """[B, sum N]: ``x`` through the [N_i, K] weights side by side, as ``F.linear`` through
    their concatenation would (the q/k/v or gate/up products of one input, the lm_head alone);
    ``bias_N``: their biases concatenated, or None.

    ``major``: each ``W_i @ x.T`` written into its rows of one [sum N, B] buffer (no
    concatenation), the result its transposed view. ``x`` is made row-major so that ``x.T`` is
    a transposed view (MKL took 4x longer over a [K, B] copy), and one row is padded to two
    (MKL's two-column product is ~2x faster than its one-column one)."""
    B = x_BK.shape[0]
    if not major:
        y_BN = torch.cat([F.linear(x_BK, w) for w in weights], -1)
    else:
        N = sum(w.shape[0] for w in weights)
        x = x_BK.contiguous() if B > 1 else torch.cat([x_BK, torch.zeros_like(x_BK)])
        out_NB, x_KB = x.new_empty((N, x.shape[0])), x.t()
        row = 0
        for w in weights:
            torch.mm(w, x_KB, out=out_NB[row : row + w.shape[0]])
            row += w.shape[0]
        y_BN = out_NB.t()[:B]
    return y_BN if bias_N is None else y_BN + bias_N


def tune(kinds: list[list[list[torch.Tensor]]], rows: int) -> None:
    """Measure both forms for ``rows`` rows, once per kind of product and thread count.
    ``kinds``: per kind (q/k/v, o, gate/up, down, lm_head), the weights of every layer's
    product of that kind (`project`'s ``weights``), timed in order as a step reads them (out of
    cache). Past `MAX_TUNED_ROWS` rows, or on another device than the CPU (cuBLAS has no such
    gap), ``F.linear``. Cost: about three reads of the weights per form and row count (~0.3 s
    for SmolLM2-135M on these machines), once per process.

    Measured with MKL, fp32, two rows, one thread, SmolLM2-135M's weights out of cache: on the
    2-core AMD EPYC (Zen 4) the weight-major form ``(W @ x.T).T`` is 2-4x faster than
    ``F.linear`` (~18 vs 2-7 GB/s; 4x on the 49k-row lm_head); on the 2-core Intel Xeon
    (Sapphire Rapids) ``F.linear`` is 2x faster (the fused q/k/v product 237 vs 442 us, gate/up
    752 vs 1,445 us, the lm_head 9.7 vs 23.3 ms), and a decoder hard-coded for the AMD
    machine's choice sampled 1.8x slower than HF's own forward."""
    for layers in kinds:
        first = layers[0]
        key = (rows, *shape(first), torch.get_num_threads())
        if key in _CHOICE or first[0].device.type != "cpu" or rows > MAX_TUNED_ROWS:
            continue
        x_BK = torch.randn(rows, first[0].shape[1], dtype=first[0].dtype)
        best = {False: float("inf"), True: float("inf")}
        with torch.no_grad():
            for _ in range(REPS):
                for major in best:
                    t0 = time.perf_counter()
                    for weights in layers:
                        project(x_BK, weights, None, major=major)
                    best[major] = min(best[major], time.perf_counter() - t0)
        _CHOICE[key] = best[True] < best[False]


def choices() -> dict[tuple, bool]:
    """What this process measured: (rows, N, K, dtype, threads) -> weight-major faster."""
    return dict(_CHOICE)


def saved() -> list[list]:
    """`choices` as plain values for a checkpoint's JSON: [rows, N, K, dtype, threads, major]."""
    return [
        [r, n, k, str(d).removeprefix("torch."), t, m]
        for (r, n, k, d, t), m in sorted(_CHOICE.items(), key=str)
    ]


def restore(forms: list[list]) -> None:
    """Take the forms a run measured (`saved`, from its checkpoint) in place of measuring them:
    the two forms differ in float rounding, so a resumed run samples with the products of the
    run it resumes (where its thread counts are the same)."""
    for r, n, k, d, t, m in forms:
        _CHOICE[(int(r), int(n), int(k), getattr(torch, d), int(t))] = bool(m)
