"""Projection build (Gemma-3 262k x SmolLM2 49k): time and peak memory vs a naive per-token loop.

The baseline is what one writes first, a dict lookup and one ``encode`` call per token, timed on
a sample and extrapolated to the whole vocabularies; each run is its own process, so its
``ru_maxrss`` is its own.
"""

from __future__ import annotations

import time

from bench.child import run_child
from tokenbridge import paths

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "tokenbridge/projection.py",
    "tokenbridge/tokenizers",
    "pipelines/projection",
    "bench/align/projection_build.py",
    "bench/child.py",
)


SAMPLE = 4000  # tokens per direction for the naive baseline


def _child(mode: str) -> dict:
    import resource

    from tokenbridge import projection
    from tokenbridge.tokenizers import load_tokenizer

    t_dir, s_dir = paths.teacher_dir(), paths.student_dir()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    t, s = load_tokenizer(t_dir), load_tokenizer(s_dir)
    load_s = time.perf_counter() - t0
    out: dict = {"load_s": load_s}
    if mode == "ours":
        t1 = time.perf_counter()
        p = projection.build_projection(
            t,
            s,
            k=8,
            teacher_rows=projection.model_rows(t_dir),
            student_rows=projection.model_rows(s_dir),
        )
        out["build_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        projection.save_projection(
            p, paths.REPO_ROOT / "outputs" / "bench" / "projection.safetensors"
        )
        out["save_s"] = time.perf_counter() - t2
        out["exact_pairs"] = int(len(p.exact_pairs()[0]))
        out["bytes"] = int(sum(getattr(p, n).nbytes for n in projection.TENSORS))
    else:
        import numpy as np

        rng = np.random.default_rng(0)
        per_token = []
        for src, dst in ((t, s), (s, t)):
            dst_index = {b: j for j, b in enumerate(dst.token_bytes()) if b}
            src_bytes = src.token_bytes()
            sample = rng.choice(len(src_bytes), SAMPLE, replace=False)
            t1 = time.perf_counter()
            for i in sample.tolist():
                b = src_bytes[i]
                if not b or b in dst_index:
                    continue
                ids = dst.encode(b.decode("utf-8", errors="replace")).ids
                w = 0.5 ** np.arange(len(ids))
                _ = dict(zip(ids.tolist(), (w / w.sum()).tolist()))
            per_token.append((time.perf_counter() - t1) / SAMPLE)
        out["build_s"] = per_token[0] * t.vocab_size + per_token[1] * s.vocab_size
        out["extrapolated_from"] = SAMPLE
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["rss_before_mb"] = rss0 / 1024
    return out


def _run(mode: str) -> dict:
    return run_child("bench.align.projection_build", mode)


def main() -> str:
    ours, naive = _run("ours"), _run("naive")
    dense_gb = 262_144 * 49_152 * 4 / 2**30
    total = ours["load_s"] + ours["build_s"] + ours["save_s"]
    ok_time = "yes" if total <= 60 else "NO"
    ok_mem = "yes" if ours["peak_rss_mb"] <= 2048 else "NO"
    return "\n".join(
        [
            "## Projection build (Gemma-3-270M x SmolLM2-135M, k=8)",
            "",
            "| | build s | peak RSS MiB | notes |",
            "|---|---:|---:|---|",
            f"| ours (batched re-tokenization + numpy) | {ours['build_s']:.1f} | "
            f"{ours['peak_rss_mb']:.0f} | + load {ours['load_s']:.1f} s, save "
            f"{ours['save_s']:.1f} s; {ours['exact_pairs']} exact pairs; file tensors "
            f"{ours['bytes'] / 2**20:.1f} MiB |",
            f"| naive per-token encode loop (extrapolated from {naive['extrapolated_from']} "
            f"tokens/direction) | {naive['build_s']:.1f} | {naive['peak_rss_mb']:.0f} | |",
            f"| dense V_t x V_s fp32 (not built) | - | {dense_gb * 1024:.0f} | for scale |",
            "",
            f"Speed-up vs naive: **{naive['build_s'] / ours['build_s']:.1f}x**. Whole command "
            f"(load + build + save) {total:.1f} s, peak {ours['peak_rss_mb']:.0f} MiB: within "
            f"the 60 s budget: {ok_time}; within 2 GB: {ok_mem}.",
        ]
    )


if __name__ == "__main__":
    print(main())
