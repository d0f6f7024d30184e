"""The teacher's top-k (+ target) outputs of one span: the blocked passes against the fused pass.

One span of the demo teacher's head output (256 rows x 262,144 columns, Gemma; k = 32 and the
target, as the cache job asks), fp32 (CPU models) and bf16, with and without a soft cap: today's
blocked passes (the cap in place on the head's buffer, the bf16 -> fp32 copy, then
`blocked.topk_fields`) against `teacher.fused_topk` eager and compiled, through
`teacher_outputs_from_logits` as `teacher_forward` calls it. Alternated in one process.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.provenance import cpu_model
from tokenbridge.teacher import fused_topk
from tokenbridge.teacher.outputs import TeacherOutputSpec, Workspace, teacher_outputs_from_logits

MEASURES = (
    "tokenbridge/teacher",
    "bench/teacher/fused_pass.py",
)
ROWS = int(os.environ.get("BENCH_FUSED_ROWS", 256))
WIDTH = 262_144
K = 32
REPS = int(os.environ.get("BENCH_FUSED_REPS", 7))
# one thread: on the shared 2-core machine, two-thread runs of the same pass swung 3x (the
# per-row ops' thread barriers wait for a descheduled thread); 0: torch's default
THREADS = int(os.environ.get("BENCH_FUSED_THREADS", 1))
VARIANTS = ("blocked", "eager", "compiled")  # `fused_topk.MODE_ENV` off / eager / compiled


def _span(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Head output with a peaked top (the teacher's), and the targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, WIDTH, generator=g) * 2
    x[:, :64] += 8.0
    return x.to(dtype), torch.randint(0, WIDTH, (ROWS,), generator=g)


def _runner(x_raw, tgt, softcap):
    """``run(variant)``: one span's outputs; seconds of the timed part."""
    spec = TeacherOutputSpec(WIDTH, topk=K, target=True)
    buf = torch.empty_like(x_raw)  # the head's product buffer (`teacher_forward`'s plain head)
    spaces = {v: Workspace() for v in VARIANTS}

    def run(variant: str) -> float:
        buf.copy_(x_raw)  # the head's product: not timed
        os.environ[fused_topk.MODE_ENV] = "off" if variant == "blocked" else variant
        t0 = time.perf_counter()
        cap = softcap
        if variant == "blocked" and softcap:  # today: capped in place in the model's dtype
            buf.div_(softcap).tanh_().mul_(softcap)
            cap = None
        teacher_outputs_from_logits(
            buf[None], spec=spec, target_ids_BT=tgt[None], workspace=spaces[variant], softcap=cap
        )
        return time.perf_counter() - t0

    return run


def measure() -> list[dict]:
    if THREADS:
        torch.set_num_threads(THREADS)
    rows = []
    before = os.environ.get(fused_topk.MODE_ENV)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for softcap in (None, 30.0):
                x, tgt = _span(dtype)
                run = _runner(x, tgt, softcap)
                first = {v: run(v) for v in VARIANTS}  # the compiled one compiles here
                times = {v: [] for v in VARIANTS}
                for _ in range(REPS):
                    for v in VARIANTS:
                        times[v].append(run(v))
                med = {v: statistics.median(ts) for v, ts in times.items()}
                rows.append({"dtype": str(dtype).split(".")[-1], "softcap": softcap,
                             "first": first, **{v: med[v] for v in VARIANTS}})  # fmt: skip
                print(rows[-1], flush=True)
    finally:
        if before is None:
            os.environ.pop(fused_topk.MODE_ENV, None)
        else:
            os.environ[fused_topk.MODE_ENV] = before
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| input | soft cap | blocked ms | fused eager ms | fused compiled ms | eager / blocked "
        "| compiled / blocked | compiled first call s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, e, c = (r[v] * 1e3 for v in VARIANTS)
        cap = "none" if r["softcap"] is None else f"{r['softcap']:g}"
        lines.append(
            f"| {r['dtype']} | {cap} | {b:.1f} | {e:.1f} | {c:.1f} | {e / b:.2f}x | {c / b:.2f}x "
            f"| {r['first']['compiled']:.1f} |"
        )
    return "\n".join(lines)


def main() -> str:
    rows = measure()
    threads = torch.get_num_threads()
    return (
        "## Teacher outputs of one span: blocked passes vs the fused pass (CPU)\n\n"
        f"One span of {ROWS} rows x {WIDTH:,} columns, top-{K} + tail + target, "
        f"{threads} thread{'s' if threads > 1 else ''} on {cpu_model()}: median of {REPS} "
        "alternated runs (`bench/teacher/fused_pass.py`). blocked: the blocked passes (the cap "
        "in place on the head's buffer, a bf16 span copied to fp32, `teacher.blocked`), the "
        "CPU's default for fp32 uncapped logits; fused: `teacher.fused_topk`, eager (the CPU's "
        "default for bf16 or capped logits) and compiled (CUDA's default), whose first call "
        "compiles (inductor's disk cache may hold it). docs/losses.md, \"Blocked passes over "
        'the vocabulary".\n\n' + table(rows) + "\n"
    )


if __name__ == "__main__":
    print(main())
