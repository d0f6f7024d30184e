"""The align job on a Dask cluster whose workers share no disk with the launcher (issue 44), its
wall time beside the in-process runner's on the same input, and its rows against that run's.

The cluster is `bench.daskcluster` (``dask scheduler`` + two ``dask worker`` processes, one
thread each, own HOME); the input, both tokenizers (marked directories) and the output are
SeaweedFS URLs (`bench.storage.seaweed`). ``python -m bench.align.on_dask`` prints the section.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

from tokenbridge import paths

MEASURES = ("pipelines/align", "pipelines/plumbing", "tokenbridge/remote_models.py",
            "bench/daskcluster.py", "bench/align/on_dask.py")  # fmt: skip
DATA = "kjv.jsonl"  # 6.8 MB of verses, as the align_job section reads
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _rows(out: Path):
    from tokenbridge.formats.shards import open_shards

    order = [("doc_id", "ascending"), ("window", "ascending")]
    return open_shards(out).table().sort_by(order)


def main() -> str:
    from bench.daskcluster import DaskCluster, upload_model_dir
    from bench.storage.seaweed import SeaweedS3
    from pipelines.align import job

    teacher, student = paths.teacher_dir(), paths.student_dir()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data"
        data.mkdir()
        shutil.copyfile(paths.corpus_dir() / DATA, data / DATA)
        size = sum(p.stat().st_size for p in data.iterdir())
        server = SeaweedS3(tmp / "weed").start()
        cluster = None
        env = mock.patch.dict(os.environ, server.env())  # this process reads the store too
        env.start()
        try:
            bucket = server.new_bucket("bench")
            local = ["--data", f"{data}/*", "--teacher", str(teacher), "--student", str(student)]
            t0 = time.perf_counter()
            fn_stats = job.run([*local, "--out", str(tmp / "fn"), "--direct_num_workers", "2"])
            fn_s = time.perf_counter() - t0
            models = f"s3://{bucket}/models"
            up = {m: upload_model_dir(tmp / "up", f"{models}/{m.name}",
                                      {n: m / n for n in TOKENIZER_FILES}) for m in (teacher, student)}  # fmt: skip
            remote = ["--data", f"{server.upload(data, bucket, 'data')}/*",
                      "--teacher", up[teacher], "--student", up[student]]  # fmt: skip
            t0 = time.perf_counter()
            cluster = DaskCluster(tmp / "dask", env=server.env()).start()
            start_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            dask_stats = job.run([*remote, "--out", f"s3://{bucket}/dask",
                                  "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
                                  f"--dask_client_address={cluster.address}",
                                  "--dask_npartitions=2"])  # fmt: skip
            dask_s = time.perf_counter() - t0
            server.download(bucket, "dask", tmp / "dask_out")
            same = _rows(tmp / "dask_out").equals(_rows(tmp / "fn"))
        finally:
            if cluster is not None:
                cluster.stop()
            env.stop()
            server.stop()
    if not same or dask_stats["windows"] != fn_stats["windows"]:
        raise RuntimeError(f"the Dask run's rows differ: {json.dumps(dask_stats)[:2000]}")
    return "\n".join([
        f"## Align job on a Dask cluster — {DATA}, {size / 1e6:.1f} MB, "
        "Gemma-3-270M teacher x SmolLM2-135M",
        "",
        f"{fn_stats['documents']} documents -> {fn_stats['windows']} "
        "windows on both runners; the Dask run's rows equal the in-process run's, row for row "
        "(sorted by document and window: files roll per bundle, so their split differs).",
        "",
        "| runner | inputs and outputs | job wall s |",
        "|---|---|---:|",
        f"| FnApiRunner, 2 workers (a text job's default: threads of one process; baseline) | "
        f"local paths | {fn_s:.1f} |",
        f"| DaskRunner, 2 workers x 1 thread, own HOME each | s3:// URLs only (tokenizers "
        f"fetched by each worker) | {dask_s:.1f} |",
        "",
        f"Dask / in-process: **{dask_s / fn_s:.2f}x** wall (the cluster's start-up, "
        f"{start_s:.1f} s, not counted; each worker's tokenizer fetch and load is).",
    ])  # fmt: skip


if __name__ == "__main__":
    print(main())
