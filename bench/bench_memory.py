"""Benchmark section "memory": the student's peak memory and step time with and without
activation checkpointing (``parallel.activation_checkpointing``), on CPU, with the trainer's
chunked logits (``parallel.logits_chunk``) and, when asked for, with whole ones.

The demo student's shape (SmolLM2-135M: 30 layers, width 576, 49,152-wide vocabulary; random
init, fp32), one row of `seq` tokens, one forward and backward of the student's CE as the trainer
computes it (`tokenbridge.losses.ce.ce` on the model's logits, or on the lm_head's input projected
`logits_chunk` positions at a time, `trainer.parallel.head`). Each measurement runs in its own
interpreter (`bench.child.run_child`), so its peak is its own (the kernel's RSS high-water mark,
reset once the model is built), and under an address-space cap of `LIMIT_GIB`: a run that does
not fit says so instead of taking the machine down.

Why the lengths measured are short: a step of all 30 layers costs ~30 s at 2k tokens on these
2-core machines (one thread), ~90 s at 4k, and a 16k one would take well over ten minutes
(attention is quadratic). The tensors a step keeps grow linearly in the length (CPU SDPA keeps
O(T) per layer; the logits are O(T x V) or O(chunk x V)), so each variant's peaks at the measured
lengths are fitted with a line (its residual shown) and read at 4k and 16k: an estimate, not a
measurement. RSS is not quite linear: under glibc's 32 MB mmap threshold freed tensors stay in
the heap, so short runs with many layers overstate what long ones keep. Checked once (chunked
logits): at 4k the line said 3.4 GiB with AC and 7.5 without, the run measured 3.75 and 6.4; at
16k, runs of 1 and 2 blocks (0.07 GiB a block with AC, 0.74 without) put 30 blocks at ~3.7 and
~23 GiB (0.16x), against the line's 8.9 and 26.9: the line is pessimistic for AC.
``TOKENBRIDGE_BENCH_MEMORY_LENGTHS=4096,16384`` measures directly where time and memory allow; a
run whose fitted peak is over the cap is skipped and named.

The variants are rows of `VARIANTS`, each a dict of the knobs `_child` takes; another axis is one
more key there and in `_student_ce`.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import torch

from bench.child import run_child
from tokenbridge import models, paths

LENGTHS = tuple(
    int(n) for n in os.environ.get("TOKENBRIDGE_BENCH_MEMORY_LENGTHS", "512,1024,2048").split(",")
)
TARGETS = (4096, 16384)  # the lengths: goal, peak(full) <= 0.5 x peak(none) at 16k
CHUNK = 256  # the trainer's default parallel.logits_chunk
# the trainer's default logits; TOKENBRIDGE_BENCH_MEMORY_WHOLE=1 adds the whole-logits pair
# (`logits_chunk=0`: ~2.5 more minutes; bench_logits.py compares the two paths themselves)
CHUNKS = (0, CHUNK) if os.environ.get("TOKENBRIDGE_BENCH_MEMORY_WHOLE") == "1" else (CHUNK,)
VARIANTS: tuple[dict, ...] = tuple(
    {"ac": ac, "logits_chunk": chunk} for chunk in CHUNKS for ac in ("none", "full")
)
LIMIT_GIB = 20.0
# one torch thread: on a 2-core machine that other jobs keep busy, two OpenMP threads ran the
# same step up to 3x slower (bench_eval.py); step times are then CPU-seconds of the work
THREADS = 1
GIB = 2**30


def _student_ce(model, ids_BT: torch.Tensor, *, logits_chunk: int) -> torch.Tensor:
    """The trainer's student CE (summed over the row's targets) on `ids_BT`: on the whole
    logits (`logits_chunk` 0) or on the lm_head's input, `logits_chunk` positions a block."""
    from tokenbridge.losses.ce import ce
    from trainer.parallel.head import head_logits

    targets_BT = torch.full_like(ids_BT, -1)
    targets_BT[:, :-1] = ids_BT[:, 1:]
    if logits_chunk:
        with head_logits(model, chunk=logits_chunk) as head:
            model(input_ids=ids_BT, use_cache=False)
        logits = head.logits
    else:
        logits = model(input_ids=ids_BT, use_cache=False).logits
    return ce(logits, targets_BT, vocab_size=model.config.vocab_size).sum


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GIB  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(seq: int, ac: str, logits_chunk: int = 0) -> dict:
    """One forward + backward in this (fresh) process: its peak RSS and step seconds."""
    from trainer.parallel import parallelize

    cap = int(LIMIT_GIB * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = models.build_model(models.ModelSpec(str(paths.student_dir()), init="random", seed=0))
    parallelize.apply_ac(model, ac)
    model.train()
    ids_BT = torch.randint(0, model.config.vocab_size, (1, seq))
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here: the step's
    with_model = _status_gib("VmRSS")
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        loss = _student_ce(model, ids_BT, logits_chunk=logits_chunk)
        loss.backward()
    except (MemoryError, RuntimeError) as e:  # the address-space cap: an allocation refused
        if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        return {"fits": False, "error": f"an allocation refused under the {LIMIT_GIB:.0f} GiB cap"}
    return {
        "fits": True,
        "step_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - cpu0,  # one thread: the work, whatever else runs
        "peak_gib": _status_gib("VmHWM"),
        "model_gib": with_model,
        "loss": float(loss) / (seq - 1),
        "layers": model.config.num_hidden_layers,
    }


def _fit(points: list[tuple[int, float]]) -> tuple[float, float, float] | None:
    """Least-squares line peak = a + b * tokens; (a, b, largest |residual|), or None if < 2."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(p for _, p in points) / n
    b = sum((t - mx) * (p - my) for t, p in points) / sum((t - mx) ** 2 for t, _ in points)
    a = my - b * mx
    return a, b, max(abs(p - (a + b * t)) for t, p in points)


def _name(variant: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant.items())


def _baseline(variant: dict) -> str:
    """The row a variant is compared with: no activation checkpointing, the same other knobs."""
    return _name({**variant, "ac": "none"})


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _measure() -> dict[str, dict[int, dict]]:
    results: dict[str, dict[int, dict]] = {_name(v): {} for v in VARIANTS}
    for seq in sorted(LENGTHS):  # variants interleaved per length: the noise hits all alike
        for variant in VARIANTS:
            done = results[_name(variant)]
            fit = _fit([(t, r["peak_gib"]) for t, r in done.items() if r["fits"]])
            if fit and fit[0] + fit[1] * seq > LIMIT_GIB:
                done[seq] = {"fits": False, "error": f"fitted peak over {LIMIT_GIB:.0f} GiB"}
                continue
            done[seq] = run_child("bench.bench_memory", seq, *variant.values())
            print(f"   {_name(variant)}, {seq} tokens: {done[seq]}", flush=True)
    return results


def main() -> str:
    results = _measure()
    lines = [
        "## Student memory: activation checkpointing (CPU)",
        "",
        f"SmolLM2-135M's shape (30 layers, random init, fp32), one row, one forward + backward "
        f"of the student CE (`tokenbridge.losses.ce`) on {CHUNK}-position blocks of the logits "
        f"(`logits_chunk={CHUNK}`, the trainer's default) or whole (`logits_chunk=0`, when "
        "asked for); "
        f"each run in its own process ({THREADS} torch thread, address space capped at "
        f"{LIMIT_GIB:.0f} GiB). CPU: {_cpu()}. Peak: the RSS high-water mark of the step (the "
        "model built before it is in it). Step times are one cold step each; the machine is "
        "shared, so the ratio is taken on the step's CPU seconds (one thread: the work done).",
        "",
        "| variant | tokens | peak RSS | model built | step wall | step CPU | CPU vs ac=none |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for seq in sorted(LENGTHS):
        for variant in VARIANTS:
            name = _name(variant)
            r, ref = results[name][seq], results[_baseline(variant)][seq]
            if not r["fits"]:
                lines.append(f"| {name} | {seq} | does not fit: {r['error']} | | | | |")
                continue
            ratio = f"{r['cpu_s'] / ref['cpu_s']:.2f}x" if ref["fits"] else "-"
            lines.append(
                f"| {name} | {seq} | {r['peak_gib']:.2f} GiB | {r['model_gib']:.2f} GiB | "
                f"{r['step_s']:.1f} s | {r['cpu_s']:.1f} s | {ratio} |"
            )
    lines += ["", *_targets(results)]
    return "\n".join(lines)


def _targets(results: dict[str, dict[int, dict]]) -> list[str]:
    """Peaks at the issue's lengths: measured where they were, else read off each variant's
    line; whether they fit under the cap; each against its ``ac=none`` row."""
    out = [
        "| variant | tokens | peak (measured or fitted) | line over the measured lengths | "
        f"under {LIMIT_GIB:.0f} GiB | vs ac=none |",
        "|---|---:|---:|---|---|---:|",
    ]
    peaks: dict[tuple[str, int], float] = {}
    for variant in VARIANTS:
        name, done = _name(variant), results[_name(variant)]
        fit = _fit([(t, r["peak_gib"]) for t, r in done.items() if r["fits"]])
        how = (
            f"{fit[0]:.2f} + {fit[1] * 1024:.3f} GiB / 1k tokens (residual <= {fit[2]:.2f} GiB)"
            if fit
            else "-"
        )
        for seq in TARGETS:
            r = done.get(seq)
            if r and r["fits"]:
                peaks[name, seq], src = r["peak_gib"], "measured"
            elif fit:
                peaks[name, seq], src = fit[0] + fit[1] * seq, "fitted"
            else:
                continue
            ref = peaks.get((_baseline(variant), seq))
            vs = f"{peaks[name, seq] / ref:.2f}x" if ref else "-"
            fits = "yes" if peaks[name, seq] <= LIMIT_GIB else "**no**"
            out.append(
                f"| {name} | {seq} | {peaks[name, seq]:.1f} GiB ({src}) | {how} | {fits} | {vs} |"
            )
    out.append("")
    for variant in VARIANTS:
        if variant["ac"] != "full":
            continue
        full = peaks.get((_name(variant), TARGETS[-1]))
        none = peaks.get((_baseline(variant), TARGETS[-1]))
        if full and none:
            verdict = "met" if full <= 0.5 * none else "**not met**"
            out.append(
                f"- Goal (issue 27), peak at {TARGETS[-1]} tokens with `full` <= 0.5x `none`, "
                f"logits_chunk={variant['logits_chunk']}: {full:.1f} / {none:.1f} GiB = "
                f"{full / none:.2f}x, {verdict}."
            )
    out.append(
        "- What AC leaves: the blocks' inputs, one block's recompute and, with whole logits, the "
        "logits and their gradient (2 x tokens x 49,152 x 4 bytes: 6 GiB at 16k). The fitted "
        "peaks are estimates (module docstring: a direct check found the line pessimistic for AC)."
    )
    return out


if __name__ == "__main__":
    print(main())
