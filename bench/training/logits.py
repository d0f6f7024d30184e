"""Logits never whole: peak memory and step time of the student's step at long sequence.

Why 2 of its 30 blocks: the logits' memory does not depend on the depth, and with activation
checkpointing a block adds only its input, so 2 blocks keep a 16k-token step near a minute on
2 cores instead of ten. The time ratio is then a bound on the chunking's cost (at 30 blocks the
lm_head is a smaller share), and one 4k-token step runs at the real depth as well.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.provenance import cpu_model

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "trainer/parallel",
    "tokenbridge/losses",
    "tokenbridge/models.py",
    "tokenbridge/model_spec.py",
    "bench/training/logits.py",
    "bench/training/memory.py",
    "bench/child.py",
)


LENGTHS = (4096, 8192, 16384)
CHUNK = 256
LAYERS = 2
FULL_DEPTH = (4096, 30)  # one length at the student's real depth: the step-time ratio there
KIB = 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(tokens: int, chunk: int, layers: int = LAYERS) -> dict:
    """One training step's forward + backward (CE on every position); peak RSS and time."""
    import torch

    from bench.training.memory import student_ce
    from tokenbridge import models, paths
    from tokenbridge.model_spec import ModelSpec
    from trainer.parallel import parallelize

    torch.manual_seed(0)
    spec = ModelSpec(
        path=str(paths.student_dir()), init="random", overrides={"num_hidden_layers": layers}
    )
    model = models.build_model(spec, device=torch.device("cpu"))
    parallelize.apply_ac(model, "full", every=1)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    total = student_ce(model, ids, logits_chunk=chunk, scored=tokens)  # every position
    loss = total / (tokens - 1)
    loss.backward()
    took = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {
        "tokens": tokens,
        "chunk": chunk,
        "step_s": took,
        "peak_gib": peak / KIB**2,
        "step_peak_gib": (peak - before) / KIB**2,
        "loss": float(loss),
    }


def main() -> str:
    from bench.child import run_child

    rows = []
    for tokens, layers in [(n, LAYERS) for n in LENGTHS] + [FULL_DEPTH]:
        whole = run_child("bench.training.logits", tokens, 0, layers)
        chunked = run_child("bench.training.logits", tokens, CHUNK, layers)
        rows.append((tokens, layers, whole, chunked))
        print(f"   {tokens} tokens, {layers} blocks: whole {whole}, chunked {chunked}", flush=True)
    lines = [
        "## Logits never whole (student step at long sequence)\n",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores. Demo student shape (SmolLM2-135M: hidden 576, "
        f"V = 49152), {LAYERS} of its 30 blocks (module docstring: why) and all 30 at "
        f"{FULL_DEPTH[0]} tokens, random init, fp32, "
        "activation checkpointing on every block, one row, CE on every position, forward + "
        f"backward. `whole`: `parallel.logits_chunk=0`; `chunked`: {CHUNK} positions per "
        "block. Step peak = peak RSS over the RSS after the model was built.\n",
        "| tokens | blocks | whole: step peak | chunked: step peak | ratio | whole: step "
        "| chunked: step | ratio | loss equal |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for tokens, layers, w, c in rows:
        same = abs(w["loss"] - c["loss"]) <= 1e-5 * abs(w["loss"])
        lines.append(
            f"| {tokens} | {layers} | {w['step_peak_gib']:.2f} GiB | {c['step_peak_gib']:.2f} GiB | "
            f"{c['step_peak_gib'] / w['step_peak_gib']:.2f}x | {w['step_s']:.1f} s | "
            f"{c['step_s']:.1f} s | {c['step_s'] / w['step_s']:.2f}x | {'yes' if same else 'NO'} |"
        )
    lines.append(
        "\nGoal (issue 27): at 16k tokens the chunked step peak <= 0.5x of the whole path's, "
        "step time <= 1.1x."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main())
