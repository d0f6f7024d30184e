"""Alignment throughput: our Numba two-pointer kernel vs TRL 1.16 GOLD's byte-offset aligner.

Both align the same tokenizations (tokenization untimed), each variant in its own subprocess so
its peak is its own; TRL also runs in its most favourable case (offset lists built before
timing, GC off). Method and baseline: docs/bench.md.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "tokenbridge/alignment",
    "tokenbridge/tokenizers",
    "bench/align/alignment.py",
)


DOC_CHARS = 2000
CORPUS_BYTES = 3_000_000
REPEATS = 5


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so it covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _documents() -> list[str]:
    from tokenbridge import paths

    docs: list[str] = []
    total = 0
    for f in sorted((paths.corpus_dir() / "shakespeare").glob("*.txt")):
        text = f.read_text(encoding="utf-8")
        for i in range(0, len(text), DOC_CHARS):
            docs.append(text[i : i + DOC_CHARS])
            total += len(docs[-1].encode())
            if total >= CORPUS_BYTES:
                return docs
    return docs


def _prepare(out: Path) -> dict:
    """Tokenize the documents once with every tokenizer; save flat arrays for the children."""
    from tokenbridge import paths
    from tokenbridge.alignment import vocab_bytes
    from tokenbridge.tokenizers import load_tokenizer

    docs = _documents()
    toks = {
        "smollm2": paths.student_dir(),
        "llama-bpe": paths.vocab_fixture("llama-bpe"),
        "gemma": paths.teacher_dir(),
    }
    arrays, info = {}, {"docs": len(docs), "bytes": sum(len(d.encode()) for d in docs)}
    for name, path in toks.items():
        tok = load_tokenizer(path)
        t0 = time.perf_counter()
        enc = tok.encode_batch(docs)
        info[f"tokenize_s_{name}"] = time.perf_counter() - t0
        info[f"tokens_{name}"] = int(enc.ids.size)
        for field in ("ids", "byte_offsets", "row_splits", "lossless"):
            arrays[f"{name}.{field}"] = getattr(enc, field)
        tab = vocab_bytes(tok)  # the children get the packed byte table, not the tokenizer
        for field in ("offsets", "data", "special", "meta"):
            arrays[f"{name}.tab_{field}"] = getattr(tab, field)
    np.savez(out, **arrays)
    return info


def _load(npz: Path, name: str) -> tuple[np.ndarray, ...]:
    z = np.load(npz)
    return tuple(z[f"{name}.{f}"] for f in ("ids", "byte_offsets", "row_splits", "lossless"))


def _table(npz: Path, name: str):
    from tokenbridge.alignment import VocabBytes

    z = np.load(npz)
    return VocabBytes(*(z[f"{name}.tab_{f}"] for f in ("offsets", "data", "special", "meta")))


def _child(variant: str, npz: Path) -> dict:
    """One measurement in this (fresh) process; returns tokens, best seconds and peak MB."""
    kind, teacher = variant.split(":")
    s_ids, s_bo, s_rs, s_ll = _load(npz, "smollm2")
    t_ids, t_bo, t_rs, t_ll = _load(npz, teacher)
    n_tokens = int(s_ids.size + t_ids.size)
    rows = s_rs.size - 1
    input_mb = (s_ids.nbytes + s_bo.nbytes + t_ids.nbytes + t_bo.nbytes) / 2**20
    if kind.startswith("ours"):
        from tokenbridge.alignment import align_flat

        s_tab, t_tab = _table(npz, "smollm2"), _table(npz, teacher)
        force = kind == "ours_dp"

        def run(n_rows=rows):
            ns, nt = int(s_rs[n_rows]), int(t_rs[n_rows])
            res = align_flat(
                student_ids=s_ids[:ns],
                student_byte_offsets=s_bo[:ns],
                student_splits=s_rs[: n_rows + 1],
                teacher_ids=t_ids[:nt],
                teacher_byte_offsets=t_bo[:nt],
                teacher_splits=t_rs[: n_rows + 1],
                student_lossless=s_ll[:n_rows],
                teacher_lossless=t_ll[:n_rows],
                student_bytes=s_tab,
                teacher_bytes=t_tab,
                force_fallback=force,
            )
            if kind == "ours_rows":
                res.rows()
            return res

        # compile / load the cached kernels on two documents only: a full warm-up run would
        # leave its freed memory in the heap and hide the real peak of the first timed run
        run(2)
    else:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.gold.gold_trainer import ULDLoss

        # called as GOLD calls it: once per document, on Python lists of [start, end] offsets
        trl_align = ULDLoss._align_by_byte_offsets
        prebuilt = kind.startswith("trl_lists")
        if prebuilt:
            before = _status_mb("VmRSS")
            s_lists = [s_bo[s_rs[b] : s_rs[b + 1]].tolist() for b in range(rows)]
            t_lists = [t_bo[t_rs[b] : t_rs[b + 1]].tolist() for b in range(rows)]
            input_mb = _status_mb("VmRSS") - before

        def run():
            groups = 0
            for b in range(rows):
                if prebuilt:
                    s, t = s_lists[b], t_lists[b]
                else:
                    s = s_bo[s_rs[b] : s_rs[b + 1]].tolist()
                    t = t_bo[t_rs[b] : t_rs[b + 1]].tolist()
                groups += len(trl_align(s, t)[0])
            return groups

        if kind.endswith("nogc"):
            gc.disable()
    # the peak counts from here: inputs and compiled kernels are loaded, tokenizers' peaks reset
    base = _status_mb("VmRSS")
    if not _reset_peak():
        raise RuntimeError("cannot reset the peak RSS mark (/proc/self/clear_refs)")
    cpu, wall = [], []
    for _ in range(REPEATS):
        c0, w0 = time.thread_time(), time.perf_counter()
        run()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    peak = _status_mb("VmHWM")
    return {
        "tokens": n_tokens,
        "s": min(cpu),
        "wall_s": min(wall),
        "peak_mb": max(0.0, peak - base),
        "input_mb": input_mb,
    }


VARIANTS = [
    ("trl_lists:llama-bpe", "TRL GOLD aligner, GC on (offset lists built before timing)"),
    ("trl_lists_nogc:llama-bpe", "TRL GOLD aligner, GC off (offset lists built before timing)"),
    ("trl_tolist:llama-bpe", "TRL GOLD aligner, GC on, incl. per-document `.tolist()`"),
    ("trl_tolist_nogc:llama-bpe", "TRL GOLD aligner, GC off, incl. per-document `.tolist()`"),
    ("ours:llama-bpe", "ours, flat arrays (one kernel call per batch)"),
    ("ours_rows:llama-bpe", "ours, flat + per-row `Alignment` objects"),
    ("ours_dp:llama-bpe", "ours, DP fallback forced on every row"),
    ("ours:gemma", "ours, flat arrays, Gemma-3 teacher (TRL refuses it)"),
    ("ours_rows:gemma", "ours, flat + per-row `Alignment` objects, Gemma-3 teacher"),
]


def _agreement(npz: Path) -> tuple[int, int]:
    """Documents where our chunks equal TRL's groups (SmolLM2 x llama-bpe), out of all."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gold.gold_trainer import ULDLoss

    from tokenbridge.alignment import align_flat

    s_ids, s_bo, s_rs, s_ll = _load(npz, "smollm2")
    t_ids, t_bo, t_rs, t_ll = _load(npz, "llama-bpe")
    res = align_flat(
        student_ids=s_ids,
        student_byte_offsets=s_bo,
        student_splits=s_rs,
        teacher_ids=t_ids,
        teacher_byte_offsets=t_bo,
        teacher_splits=t_rs,
    )
    same = 0
    for b in range(s_rs.size - 1):
        sg, tg = ULDLoss._align_by_byte_offsets(
            s_bo[s_rs[b] : s_rs[b + 1]].tolist(), t_bo[t_rs[b] : t_rs[b + 1]].tolist()
        )
        al = res.row(b)
        ours_s = [np.flatnonzero(al.student_chunk == c).tolist() for c in range(al.n_chunks)]
        ours_t = [np.flatnonzero(al.teacher_chunk == c).tolist() for c in range(al.n_chunks)]
        same += ours_s == sg and ours_t == tg
    return same, s_rs.size - 1


def main() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "tok.npz"
        info = _prepare(npz)
        results = {}
        for variant, _ in VARIANTS:
            print(f"  alignment bench: {variant}", flush=True)
            out = subprocess.run(
                [sys.executable, "-m", "bench.align.alignment", "--child", variant, str(npz)],
                capture_output=True,
                text=True,
                timeout=1800,
                check=True,
            )
            results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        same, n_docs = _agreement(npz)
    import trl

    best_trl = max(r["tokens"] / r["s"] for v, r in results.items() if v.startswith("trl"))
    best_trl_wall = max(
        r["tokens"] / r["wall_s"] for v, r in results.items() if v.startswith("trl")
    )
    lines = [
        "## Alignment throughput (`bench/align/alignment.py`)\n",
        f"{info['docs']} documents of ~{DOC_CHARS} characters, {info['bytes'] / 1e6:.1f} MB of "
        f"Shakespeare; SmolLM2 {info['tokens_smollm2']:,} tokens, llama-bpe "
        f"{info['tokens_llama-bpe']:,}, Gemma-3 {info['tokens_gemma']:,}. Tokens/s count student "
        f"+ teacher tokens, tokenization excluded; best of {REPEATS}; each variant in its own "
        f"process. Baseline: TRL {trl.__version__} `ULDLoss._align_by_byte_offsets`; ratios are "
        "against the fastest TRL variant. All variants are single-threaded; the primary figure "
        "divides by the thread's CPU time, because on this shared 2-core machine wall-clock time "
        "includes the time the process waits for a core (wall figures shown too). Peak = growth "
        "of the peak RSS (VmHWM) over the timed calls.\n",
        "| variant | teacher | tokens/s (CPU) | vs fastest TRL | tokens/s (wall) | vs fastest TRL "
        "(wall) | peak MB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for variant, label in VARIANTS:
        r = results[variant]
        teacher = variant.split(":")[1]
        rate, wall = r["tokens"] / r["s"], r["tokens"] / r["wall_s"]
        lines.append(
            f"| {label} | {teacher} | {rate / 1e6:.2f}M | {rate / best_trl:.1f}x "
            f"| {wall / 1e6:.2f}M | {wall / best_trl_wall:.1f}x | {r['peak_mb']:.0f} |"
        )
    lists_mb = results["trl_lists:llama-bpe"]["input_mb"]
    arrays_mb = results["ours:llama-bpe"]["input_mb"]
    tok_s = info["tokenize_s_smollm2"] + info["tokenize_s_llama-bpe"]
    ours_s = results["ours:llama-bpe"]["wall_s"]
    lines += [
        "",
        f"Inputs: the offsets as TRL's Python lists take {lists_mb:.0f} MB, our ids + offsets "
        f"arrays {arrays_mb:.0f} MB (not counted in the peaks above). "
        f"Our chunks equal TRL's groups on {same} of {n_docs} documents (SmolLM2 x llama-bpe). "
        f"Tokenizing the same text with both tokenizers took {tok_s:.1f} s; aligning it "
        f"{ours_s * 1e3:.0f} ms ({100 * ours_s / tok_s:.2f}% of tokenization).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], Path(sys.argv[3]))))
    else:
        print(main())
