"""Student memory: peak and step time with and without activation checkpointing, at 4k and 16k
tokens on CPU.

Why 1 and 2 blocks, not 30: a 30-block step at 16k tokens takes well over ten minutes here. A
step holds the most at one end of its backward (every block's saved tensors, or every gradient),
and both ends are lines in the number of blocks: the runs at 1 and 2 blocks give the lines, read
at 30 (`DEPTH`), and one real 30-block run at `CHECK` tokens checks them (docs/bench.md).
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import torch

from bench.child import run_child
from tokenbridge import models, paths

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "trainer/parallel",
    "tokenbridge/losses",
    "tokenbridge/models.py",
    "bench/training/memory.py",
    "bench/child.py",
)


TARGETS = (4096, 16384)  # the lengths: goal, peak(full) <= 0.5 x peak(none) at 16k
CHECK = 512  # tokens at which 30 blocks are run too, to check the line in the number of blocks
DEPTHS = (1, 2)
DEPTH = 30  # SmolLM2-135M's blocks
CHUNK = 256  # the trainer's default parallel.logits_chunk
# the CE scores the last SCORED positions only: the chunked CE projects only the rows it scores
# and holds O(chunk x V) whatever their number (its gradient reaches the [T, 576] hidden states
# either way); scoring all 16k rows would triple the run time
SCORED = CHUNK
# TOKENBRIDGE_BENCH_MEMORY_WHOLE=1 adds the whole-logits pair (`logits_chunk=0`; logits.py
# compares the two logits paths themselves)
CHUNKS = (CHUNK, 0) if os.environ.get("TOKENBRIDGE_BENCH_MEMORY_WHOLE") == "1" else (CHUNK,)
# each a dict of the knobs `_child` takes: another axis is one more key here and in `student_ce`
VARIANTS: tuple[dict, ...] = tuple(
    {"ac": ac, "logits_chunk": chunk} for chunk in CHUNKS for ac in ("none", "full")
)
LIMIT_GIB = 20.0  # address-space cap: a run that does not fit says so, not takes the machine down
# glibc's mmap threshold fixed, so any tensor over 128 KiB is its own mmap and a freed one leaves
# RSS at once: the peak is what the step holds, not the heap's history (without it, repeated
# runs differed by 0.5 GiB)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
# one torch thread: on a 2-core machine that other jobs keep busy, two OpenMP threads ran the
# same step up to 3x slower (eval.py); step times are then CPU-seconds of the work
THREADS = 1
GIB = 2**30


def student_ce(
    model, ids_BT: torch.Tensor, *, logits_chunk: int, scored: int = SCORED
) -> torch.Tensor:
    """The trainer's student CE (summed) on the last `scored` positions of `ids_BT`: on the
    lm_head's input, `logits_chunk` rows a block, or on the whole logits (`logits_chunk` 0)."""
    from tokenbridge.losses.ce import ce
    from trainer.parallel.head import head_logits

    targets_BT = torch.full_like(ids_BT, -1)
    lo = max(ids_BT.shape[1] - 1 - scored, 0)  # position i predicts token i + 1
    targets_BT[:, lo:-1] = ids_BT[:, lo + 1 :]
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


def _child(seq: int, layers: int, ac: str, logits_chunk: int) -> dict:
    """One forward + backward in this (fresh) process: its peak RSS and step seconds."""
    from trainer.parallel import parallelize

    cap = int(LIMIT_GIB * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    spec = models.ModelSpec(
        str(paths.student_dir()), init="random", seed=0, overrides={"num_hidden_layers": layers}
    )
    model = models.build_model(spec)
    parallelize.apply_ac(model, ac)
    model.train()
    ids_BT = torch.randint(0, model.config.vocab_size, (1, seq))
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here: the step's
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        student_ce(model, ids_BT, logits_chunk=logits_chunk).backward()
    except (MemoryError, RuntimeError) as e:  # the address-space cap: an allocation refused
        if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        return {"fits": False}
    return {
        "fits": True,
        "step_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - cpu0,  # one thread: the work, whatever else runs
        "peak_gib": _status_gib("VmHWM"),
        "after_gib": _status_gib("VmRSS"),  # every gradient held, every activation freed
    }


def _name(variant: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in variant.items())


def _baseline(variant: dict) -> str:
    """The row a variant is compared with: no activation checkpointing, the same other knobs."""
    return _name({**variant, "ac": "none"})


def _runs() -> list[tuple[int, int]]:
    """(tokens, blocks) of every run, cheapest first."""
    return [(CHECK, d) for d in (*DEPTHS, DEPTH)] + [(t, d) for t in TARGETS for d in DEPTHS]


def _measure() -> dict[str, dict[tuple[int, int], dict]]:
    results: dict[str, dict[tuple[int, int], dict]] = {_name(v): {} for v in VARIANTS}
    for seq, layers in _runs():  # variants interleaved: the machine's noise hits all alike
        for variant in VARIANTS:
            r = run_child("bench.training.memory", seq, layers, *variant.values(), env=MALLOC)
            results[_name(variant)][seq, layers] = r
            print(f"   {_name(variant)}, {seq} tokens, {layers} blocks: {r}", flush=True)
    return results


def _at_depth(done: dict, seq: int) -> tuple[float, float, float] | None:
    """At `DEPTH` blocks, from the runs with 1 and 2 blocks at `seq`: (the peak while the
    activations dominate, the RSS once every gradient is held, GiB per block of the former)."""
    one, two = done.get((seq, DEPTHS[0])), done.get((seq, DEPTHS[1]))
    if not (one and two and one["fits"] and two["fits"]):
        return None

    def line(key: str) -> tuple[float, float]:
        per = (two[key] - one[key]) / (DEPTHS[1] - DEPTHS[0])
        return one[key] + per * (DEPTH - DEPTHS[0]), per

    (peak, per), (after, _) = line("peak_gib"), line("after_gib")
    return peak, after, per


def main() -> str:
    results = _measure()
    lines = [
        "## Student memory: activation checkpointing (CPU)",
        "",
        f"SmolLM2-135M's shape (random init, fp32), one row, one forward + backward of the "
        f"student CE (`tokenbridge.losses.ce`) on the last {SCORED} positions, logits "
        f"projected {CHUNK} rows at a time (`logits_chunk={CHUNK}`, the trainer's default"
        f"{'; `logits_chunk=0`: whole' if 0 in CHUNKS else ''}); each run in its own process "
        f"({THREADS} torch thread, glibc mmap threshold 128 KiB, address space capped at "
        f"{LIMIT_GIB:.0f} GiB). Peak: the step's RSS high-water mark (the model's own weights "
        f"in it). {DEPTH} blocks: read off lines through the runs with 1 and 2, one for the "
        "peak while activations dominate and one for the RSS once every gradient is held; the "
        "step's peak is the larger (module docstring: why). Step ratios are on CPU seconds "
        "(one thread: the work done; the machine is shared).",
        "",
        f"| variant | tokens | {DEPTH} blocks: activations | gradients | peak | per block | "
        f"measured, {DEPTH} blocks | under {LIMIT_GIB:.0f} GiB | vs ac=none | step CPU, "
        f"{DEPTHS[-1]} blocks | vs ac=none |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    peaks: dict[tuple[str, int], float] = {}
    for seq in (CHECK, *TARGETS):
        for variant in VARIANTS:
            name, base = _name(variant), _baseline(variant)
            done, line = results[name], _at_depth(results[name], seq)
            if line is None:
                lines.append(f"| {name} | {seq} | does not fit | | | | | | | | |")
                continue
            acts, grads, per = line
            peaks[name, seq] = peak = max(acts, grads)
            real = done.get((seq, DEPTH))
            measured = f"{real['peak_gib']:.2f} GiB" if real and real["fits"] else "-"
            vs = peak / peaks[base, seq] if (base, seq) in peaks else None
            step, ref = done[seq, DEPTHS[-1]], results[base][seq, DEPTHS[-1]]
            lines.append(
                f"| {name} | {seq} | {acts:.2f} GiB | {grads:.2f} GiB | **{peak:.2f} GiB** | "
                f"{per:.3f} GiB | {measured} | {'yes' if peak <= LIMIT_GIB else '**no**'} | "
                f"{f'{vs:.2f}x' if vs else '-'} | {step['cpu_s']:.1f} s | "
                f"{step['cpu_s'] / ref['cpu_s']:.2f}x |"
            )
    lines.append("")
    for variant in VARIANTS:
        full = peaks.get((_name(variant), TARGETS[-1]))
        none = peaks.get((_baseline(variant), TARGETS[-1]))
        if variant["ac"] == "full" and full and none:
            verdict = "met" if full <= 0.5 * none else "**not met**"
            lines.append(
                f"- Goal (issue 27), peak at {TARGETS[-1]} tokens with `full` <= 0.5x `none`, "
                f"logits_chunk={variant['logits_chunk']}: {full:.1f} / {none:.1f} GiB = "
                f"{full / none:.2f}x, {verdict}."
            )
    lines.append(
        "- What AC leaves: each block's input (T x 576 floats) and its weights' gradients, one "
        "block's recompute, and the logits' own memory (whole logits: 2 x T x 49,152 floats)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
