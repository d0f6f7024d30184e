"""Checksums (issue 20): what they cost at write and at verify, and what they add to real jobs.

The candidate hashes, a large file written through `HashingSink` and verified, `make align` on
the KJV and a debug training run, all in one run: read the shares, since absolute GB/s move with
the load of the shared cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.provenance import cpu_model
from tokenbridge import paths

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "tokenbridge/formats",
    "tokenbridge/projection.py",
    "pipelines/align",
    "pipelines/plumbing",
    "bench/training/integrity.py",
)


BUF_MB = 256
FILE_MB = 512


def _best(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def hashes() -> dict[str, float]:
    import xxhash

    data = memoryview(os.urandom(BUF_MB << 20))
    makers = {
        "blake2b (hashlib, 16-byte digest)": lambda: hashlib.blake2b(digest_size=16),
        "xxh64": xxhash.xxh64,
        "xxh3_64 (chosen)": xxhash.xxh3_64,
        "xxh3_128": xxhash.xxh3_128,
    }

    def run(make):
        h = make()
        for i in range(0, len(data), 1 << 20):
            h.update(data[i : i + (1 << 20)])
        h.digest()

    return {name: len(data) / _best(lambda m=m: run(m)) / 1e9 for name, m in makers.items()}


def files(tmp: Path) -> dict[str, float]:
    from tokenbridge.formats import checksums

    block = os.urandom(8 << 20)
    n = (FILE_MB << 20) // len(block)

    def plain():
        with open(tmp / "plain", "wb") as f:
            for _ in range(n):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    def hashed():
        sink = checksums.HashingSink(tmp / "hashed")
        for _ in range(n):
            sink.write(block)
        sink.close()

    def read():
        with open(tmp / "hashed", "rb", buffering=0) as f:
            buf = bytearray(8 << 20)
            while f.readinto(buf):
                pass

    size = n * len(block)
    out = {"write plain": size / _best(plain), "write + hash (HashingSink)": size / _best(hashed)}
    checksums.COST.write_seconds = 0.0
    t0 = time.perf_counter()
    hashed()
    out["hash share"] = checksums.COST.write_seconds / (time.perf_counter() - t0) * 1e9
    out["read plain (page cache)"] = size / _best(read)
    out["verify (hash_file, page cache)"] = size / _best(
        lambda: checksums.hash_file(tmp / "hashed")
    )
    return {k: v / 1e9 for k, v in out.items()}


def _align_child(out: str) -> dict:
    from pipelines.align import align_dofns, job
    from tokenbridge.formats import checksums, shards, value_checks

    t_dir, s_dir = str(paths.teacher_dir()), str(paths.student_dir())
    (
        align_dofns.cached_tokenizer(t_dir),
        align_dofns.cached_tokenizer(s_dir),
    )  # load once, outside the timing
    argv = ["--data", str(paths.corpus_dir() / "kjv.jsonl"), "--teacher", t_dir, "--student",
            s_dir, "--out", out, "--overwrite", "--direct_num_workers", "1"]  # fmt: skip
    t0 = time.perf_counter()
    job.run(argv)
    job_s = time.perf_counter() - t0
    write_s = checksums.COST.write_seconds
    t0 = time.perf_counter()
    reports = checksums.verify_dir(out)
    verify_s = time.perf_counter() - t0
    assert all(r.ok for r in reports), [r.error for r in reports if not r.ok]
    size = sum(r.bytes or 0 for r in reports)
    # the value checks a reader runs on every record batch it hands on (`tokenbridge.formats.value_checks`)
    ss = shards.open_shards(out, verify="never")
    batches = list(ss.iter_batches())
    t0 = time.perf_counter()
    for b in batches:
        value_checks.check_batch(b, ss.meta, where=out)
    check_s = time.perf_counter() - t0
    return {"job_s": job_s, "bytes": size, "files": len(reports), "verify_s": verify_s,
            "hash_at_write_s": write_s, "check_s": check_s, "check_rows": ss.num_rows,
            "shard_bytes": sum(p.stat().st_size for p in ss.files)}  # fmt: skip


def _subprocess_json(code: str, out: Path, timeout: int = 1800) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], cwd=paths.REPO_ROOT, check=True, env=env,
                   timeout=timeout)  # fmt: skip
    return json.loads(out.read_text())


def align(tmp: Path) -> dict:
    res = tmp / "align.json"
    code = (f"import json; from bench.training.integrity import _align_child; "
            f"open({str(res)!r}, 'w').write(json.dumps(_align_child({str(tmp / 'shards')!r})))")  # fmt: skip
    return _subprocess_json(code, res)


def train(tmp: Path) -> dict:
    from bench.common import ensure_projection, run_trainer, shakespeare_docs
    from tokenbridge.alignment.text_shards import write_text_shards
    from tokenbridge.formats import checksums

    projection = ensure_projection()
    shards = write_text_shards(tmp / "debug-shards", shakespeare_docs(24, chars=700),
                               student_dir=paths.student_dir(),
                               teacher_dirs=[paths.teacher_dir()])  # fmt: skip
    run = tmp / "run"
    args = ["conf=debug", f"data.shards={shards}", f"run_dir={run}", "logging.progress=false",
            "parallel.threads=1", "device=cpu", f"teachers.0.projection={projection}",
            "checkpoint.export_at_end=false"]  # fmt: skip
    t0 = time.perf_counter()
    proc = run_trainer(args, nproc=1, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"debug run failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    t0 = time.perf_counter()
    assert all(r.ok for r in checksums.verify_dir(newest))
    resume_s = time.perf_counter() - t0
    ckpt_bytes = sum(p.stat().st_size for p in newest.iterdir())
    shard_bytes = sum(p.stat().st_size for p in shards.iterdir())
    return {"wall_s": wall, "train_s": summary["train_seconds"], "resume_verify_s": resume_s,
            "ckpt_bytes": ckpt_bytes, "shard_bytes": shard_bytes, **summary["integrity"]}  # fmt: skip


def main() -> str:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        h, f = hashes(), files(tmp)
        a, t = align(tmp), train(tmp)
    return render(h, f, a, t, load=(load, os.getloadavg()[0]))


def _train_share(t: dict) -> float:
    spent = t["verify_s"] + t["value_check_s"] + t["hash_at_write_s"] + t["resume_verify_s"]
    return spent / t["wall_s"]


def render(h: dict, f: dict, a: dict, t: dict, *, load: tuple[float, float]) -> str:
    blake = h["blake2b (hashlib, 16-byte digest)"]
    lines = [
        f"## Checksums (issue 20) — {cpu_model()}, 2 shared cores",
        "",
        f"The machine was shared: 1-minute load average {load[0]:.1f} at the start of the "
        f"section, {load[1]:.1f} at its end (2 cores); absolute GB/s drop with it, the shares "
        "of a job are measured under the same load as the job.",
        "",
        f"Hashes over {BUF_MB} MiB in memory (1 MiB updates, best of 3):",
        "",
        "| hash | GB/s | x blake2b |",
        "|---|---:|---:|",
        *[f"| {k} | {v:.2f} | {v / blake:.1f}x |" for k, v in h.items()],
        "",
        f"A {FILE_MB} MiB file (fsynced writes; reads from the page cache):",
        "",
        "| | GB/s |",
        "|---|---:|",
        *[f"| {k} | {v:.2f} |" for k, v in f.items() if k != "hash share"],
        "",
        f"Inside one write through `HashingSink` the hash updates take "
        f"**{f['hash share']:.1%} of the write's time** (timed inside the write; the plain and "
        "hashed rows above also differ by the disk's noise); verify runs at "
        f"**{f['verify (hash_file, page cache)']:.2f} GB/s** from the page cache (target >= 1 "
        "GB/s; from a cold disk it runs at the disk's read speed).",
        "",
        f"- `make align` on KJV (1 process): job {a['job_s']:.1f} s, {a['files']} files, "
        f"{a['bytes'] / 1e6:.1f} MB; hashing inside the writers {a['hash_at_write_s']:.3f} s = "
        f"**{a['hash_at_write_s'] / a['job_s']:.2%} of the job**; verifying the output "
        f"afterwards (`python -m tokenbridge.commands.verify`'s hashing) {a['verify_s']:.3f} s = "
        f"{a['verify_s'] / a['job_s']:.2%}; the value checks of all its record batches "
        f"({a['check_rows']} rows, {a['shard_bytes'] / 1e6:.1f} MB of shards) "
        f"{a['check_s']:.3f} s = {a['shard_bytes'] / a['check_s'] / 1e9:.2f} GB/s of shard.",
        f"- debug training run (1 process, 20 steps, 2 checkpoints of "
        f"{t['ckpt_bytes'] / 1e6:.1f} MB, shards {t['shard_bytes'] / 1e6:.2f} MB): wall "
        f"{t['wall_s']:.1f} s; shards verified {t['verify_s']:.3f} s, values of "
        f"{t['value_checked_rows']} rows checked {t['value_check_s']:.3f} s, checkpoints hashed "
        f"while written {t['hash_at_write_s']:.3f} s, the newest verified as a resume does "
        f"{t['resume_verify_s']:.3f} s: together **{_train_share(t):.2%} of the run** "
        "(target <= 2%).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
