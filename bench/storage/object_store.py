"""Object storage (issue 26): the align job writing to ``s3://`` and the trainer reading its
shards from ``s3://``, each against local files in the same run, on a SeaweedFS server on
loopback (`bench.storage.seaweed`).

Loopback is no network: the ratios say what the code adds, not what a real store costs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.child import run_child
from tokenbridge import paths

DATA = "kjv.jsonl"
STEPS = 12


def _align_child(out: str) -> dict:
    import resource

    from pipelines.align import align_dofns, job

    t_dir, s_dir = str(paths.teacher_dir()), str(paths.student_dir())
    (
        align_dofns.cached_tokenizer(t_dir),
        align_dofns.cached_tokenizer(s_dir),
    )  # loaded outside the timing
    argv = ["--data", str(paths.corpus_dir() / DATA), "--teacher", t_dir, "--student", s_dir,
            "--out", out, "--overwrite", "--direct_num_workers", "1"]  # fmt: skip
    t0 = time.perf_counter()
    stats = job.run(argv)
    return {
        "job_s": time.perf_counter() - t0,
        "shards": stats["shards"],
        "windows": stats["windows"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _child(out: str) -> dict:
    return _align_child(out)


def align(server, bucket: str, tmp: Path) -> list[dict]:
    """Local, S3, local, S3: each in a fresh process."""
    runs = []
    for i, where in enumerate(["local", "s3", "local", "s3"]):
        out = str(tmp / f"align{i}") if where == "local" else f"s3://{bucket}/align{i}"
        res = run_child("bench.storage.object_store", out, env=server.env())
        runs.append({"where": where, **res})
    return runs


def _steps(run_dir: Path) -> list[float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_s"] for r in recs if r.get("kind") == "train" and r["step"] > 2]


def train(server, bucket: str, tmp: Path) -> list[dict]:
    from bench.common import ensure_projection, run_trainer, shakespeare_docs
    from tokenbridge.alignment.text_shards import write_text_shards

    projection = ensure_projection()
    shards = write_text_shards(tmp / "shards", shakespeare_docs(48, chars=700),
                               student_dir=paths.student_dir(),
                               teacher_dirs=[paths.teacher_dir()], max_tokens=64,
                               num_files=4)  # fmt: skip
    url = server.upload(shards, bucket, "shards")
    shard_bytes = sum(p.stat().st_size for p in shards.iterdir() if p.is_file())
    runs = []
    for i, where in enumerate(["local", "s3", "stream"] * 2):
        run_dir, cache = tmp / f"run{i}", tmp / f"cache{i}"
        stream = ["data.stream=true"] if where == "stream" else []  # 3 files on disk
        args = [*stream, "conf=debug", f"data.shards={shards if where == 'local' else url}",
                f"run_dir={run_dir}", f"steps={STEPS}", "eval.max_texts=0",
                f"data.cache_dir={cache}", f"teachers.0.projection={projection}",
                "checkpoint.save_at_end=false", "checkpoint.export_at_end=false",
                "logging.progress=false", "parallel.threads=1", "device=cpu"]  # fmt: skip
        t0 = time.perf_counter()
        proc = run_trainer(args, nproc=2, timeout=1800, env=server.env())
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"debug run failed:\n{proc.stderr[-3000:]}")
        fetched = sum(p.stat().st_size for p in cache.rglob("*.arrow")) if cache.exists() else 0
        if where == "stream":  # evicted as it goes: its record of every download instead
            fetched = sum(int(line.split()[1]) for log in cache.rglob(".downloads")
                          for line in log.read_text().splitlines())  # fmt: skip
        summary = json.loads((run_dir / "summary.json").read_text())
        runs.append({"where": where, "wall_s": wall, "step_s": statistics.median(_steps(run_dir)),
                     "train_s": summary["train_seconds"], "fetched": fetched,
                     "shard_bytes": sum(p.stat().st_size for p in shards.glob("*.arrow")),
                     "dir_bytes": shard_bytes})  # fmt: skip
    return runs


def _pair(runs: list[dict], key: str, other: str = "s3") -> tuple[float, float]:
    loc = statistics.median(r[key] for r in runs if r["where"] == "local")
    s3 = statistics.median(r[key] for r in runs if r["where"] == other)
    return loc, s3


def main() -> str:
    from bench.storage.seaweed import SeaweedS3

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        server = SeaweedS3(tmp / "weed").start()
        try:
            bucket = server.new_bucket("bench")
            a, t = align(server, bucket, tmp), train(server, bucket, tmp)
        finally:
            server.stop()
    a_loc, a_s3 = _pair(a, "job_s")
    r_loc, r_s3 = _pair(a, "peak_rss_mb")
    s_loc, s_s3 = _pair(t, "step_s")
    w_loc, w_s3 = _pair(t, "wall_s")
    _, s_st = _pair(t, "step_s", "stream")
    _, w_st = _pair(t, "wall_s", "stream")
    _, f_st = _pair(t, "fetched", "stream")
    fetched = statistics.median(r["fetched"] for r in t if r["where"] == "s3")
    shard_bytes = t[0]["shard_bytes"]
    lines = [
        "## Object storage — align job and trainer against S3 (SeaweedFS on loopback)",
        "",
        f"Align job, {DATA}, FnApiRunner in-process, {a[0]['windows']} windows in "
        f"{a[0]['shards']} shards (median of 2 runs each, alternating):",
        "",
        "| output | job s | peak RSS MiB |",
        "|---|---:|---:|",
        f"| local directory (baseline) | {a_loc:.1f} | {r_loc:.0f} |",
        f"| s3:// | {a_s3:.1f} | {r_s3:.0f} |",
        "",
        f"S3 / local: **{a_s3 / a_loc:.2f}x** time, {r_s3 / r_loc:.2f}x peak RSS.",
        "",
        f"Trainer, conf=debug, 2 ranks on one node, {STEPS} steps (median of 2 runs each, in turn):",
        "",
        "| shards | median step s (steps 3+) | run wall s |",
        "|---|---:|---:|",
        f"| local (baseline) | {s_loc:.3f} | {w_loc:.1f} |",
        f"| s3:// | {s_s3:.3f} | {w_s3:.1f} |",
        f"| s3://, data.stream=true (3 of 4 files on disk) | {s_st:.3f} | {w_st:.1f} |",
        "",
        f"Steady-state step time S3 / local: **{s_s3 / s_loc:.3f}x** (goal <= 1.05x); run wall "
        f"time {w_s3 / w_loc:.2f}x (the fetch is at the start). Shard bytes fetched for the "
        f"node: {fetched:,} of {shard_bytes:,} (**{fetched / shard_bytes:.2f}x**; goal 1.00x: "
        "each file once, by local rank 0). Streamed (each file fetched as the reader reaches "
        f"it, the next in the background): **{s_st / s_loc:.3f}x** the local step (goal <= "
        f"1.05x), run wall time {w_st / w_loc:.2f}x; bytes fetched {f_st:,.0f} "
        f"(**{f_st / shard_bytes:.2f}x** the shards: a file evicted and needed again is fetched "
        "again).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
