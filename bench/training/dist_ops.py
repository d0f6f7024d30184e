"""Vocab-parallel ops (`tokenbridge.dist_ops`), chunked vs unchunked: time and peak memory at
Gemma-3's vocabulary, TP = 2 on gloo.

"Unchunked" is the same autograd Function with one chunk holding every row, so the comparison is
of the chunking alone; it runs at the longest sequence this machine's free memory allows, and
the chunked op at that length too, so every ratio compares equal work.
"""

from __future__ import annotations

import gc
import os
import re
import time

import torch

from tokenbridge.dist_ops import vp_entropy, vp_soft_ce, vp_target_logprobs
from trainer.parallel.spawn import spawn

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "tokenbridge/dist_ops",
    "trainer/parallel",
    "bench/training/dist_ops.py",
)


V = 262_144
T = int(os.environ.get("TB_BENCH_DIST_T", 4_096))  # smaller T only for a quick smoke run
TP = 2
OPS = ("target_logprobs", "entropy", "soft_ce")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(re.search(r"MemAvailable:\s+(\d+)", f.read()).group(1)) / 2**20


def _run_op(op: str, logits, target, w, group, chunk_size):
    leaf = logits.detach().requires_grad_(True)
    if op == "target_logprobs":
        out = vp_target_logprobs(leaf, target, group, chunk_size=chunk_size)
    elif op == "entropy":
        out = vp_entropy(leaf, group, chunk_size=chunk_size)
    else:
        out = vp_soft_ce(leaf, target, group, chunk_size=chunk_size)
    (out * w).sum().backward()
    return leaf.grad


def _measure(op: str, logits, target, chunk_size, group) -> tuple[float, float]:
    w = torch.ones(logits.shape[0])
    gc.collect()
    torch.distributed.barrier(group)
    _reset_peak()
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    grad = _run_op(op, logits, target, w, group, chunk_size)
    took = time.perf_counter() - t0
    peak = (_status_kib("VmHWM") - before) / 2**20
    del grad
    return took, peak


def _rank_main(rank: int, world_size: int, plain_rows: int) -> dict:
    group = torch.distributed.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    v_local = V // TP
    # random rows tiled to [T, V / TP]: the ops' cost does not depend on the values, and
    # drawing 0.5G normals per rank would cost more than the ops
    block = torch.randn(256, v_local, generator=gen) * 3
    logits = block.to(torch.bfloat16).repeat(T // 256, 1)
    probs = torch.softmax(block, -1).div_(TP).to(torch.bfloat16).repeat(T // 256, 1)
    ids = torch.randint(0, V, (T,), generator=gen)
    del block
    out = {}
    for op in OPS:
        target = {"target_logprobs": ids, "soft_ce": probs}.get(op)
        for rows, variant in ((T, "chunked"), (plain_rows, "chunked"), (plain_rows, "unchunked")):
            if (op, variant, rows) in out:
                continue
            tgt = None if target is None else target[:rows]
            # unchunked: one chunk of every row; None: the default (~8M elements: 64 rows here)
            chunk = rows if variant == "unchunked" else None
            out[(op, variant, rows)] = _measure(op, logits[:rows], tgt, chunk, group)
    return out


def _plain_rows() -> int:
    forced = os.environ.get("TB_BENCH_PLAIN_T")
    if forced:
        return int(forced)
    avail = _mem_available_gib()
    v_local = V // TP
    # unchunked at T = 4,096 needs about 16 GiB over the two ranks, inputs included
    for rows in (4096, 2048, 1024, 512):
        # per rank: bf16 logits + bf16 teacher probs at T, then for the unchunked call the bf16
        # gradient and two fp32 [rows, V / TP] buffers (entropy / soft CE backward)
        need = TP * (T * v_local * 4 + rows * v_local * 10) / 2**30
        if need < 0.5 * avail:  # leave room: the machine is shared
            return rows
    return 512


def main() -> str:
    plain_rows = _plain_rows()
    per_rank = spawn(_rank_main, world_size=TP, args=(plain_rows,), timeout_s=600.0)
    res = {k: (max(r[k][0] for r in per_rank), max(r[k][1] for r in per_rank)) for k in per_rank[0]}
    lines = [
        "## Vocab-parallel ops: chunked vs unchunked (TP = 2, gloo, CPU)",
        "",
        f"V = {V:,} (bf16 shard [T, {V // TP:,}] per rank), forward + backward, 2 processes x 1 "
        f"thread. Unchunked baseline at T = {plain_rows:,}"
        + (
            ""
            if plain_rows == T
            else " (set by TB_BENCH_PLAIN_T)"
            if os.environ.get("TB_BENCH_PLAIN_T")
            else " (all that fits in this machine's free memory)"
        )
        + ". Peak = extra resident memory during the call (incl. the bf16 gradient), max over "
        "ranks.",
        "",
        f"| op | T | unchunked time | chunked time | time ratio | unchunked peak | chunked peak "
        f"| memory ratio | chunked at T = {T:,} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for op in OPS:
        tp_, mp_ = res[(op, "unchunked", plain_rows)]
        tc, mc = res[(op, "chunked", plain_rows)]
        t4, m4 = res[(op, "chunked", T)]
        lines.append(
            f"| `vp_{op}` | {plain_rows:,} | {tp_:.2f} s | {tc:.2f} s | {tc / tp_:.2f}x "
            f"| {mp_:.2f} GiB | {mc:.2f} GiB | {mc / mp_:.2f}x | {t4:.2f} s, {m4:.2f} GiB |"
        )
    lines += [
        "",
        "Ratios are chunked / unchunked at equal T (below 1 = chunked is better). The chunked "
        "peak is the gradient plus a few fp32 [64, V / 2] buffers, flat in T beyond the "
        "gradient; the unchunked peak grows with several fp32 [T, V / 2] temporaries.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
