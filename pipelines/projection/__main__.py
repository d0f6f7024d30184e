"""The projection job: two model directories -> a sparse vocabulary projection file.

    python -m pipelines.projection --teacher T --student S [--k 8] [--out FILE]

The builder and the file format are the library's (`tokenbridge.projection`). The file is read
back here as the trainer will read it, so a bad build is refused now, not at training time. No
pipeline: one batched re-tokenization per direction is quick. An ``s3://`` ``--out`` is built
and checked locally, then uploaded (`pipelines.plumbing.storage`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from pipelines.plumbing import jobs, storage
from tokenbridge import cli, remote_models, urls
from tokenbridge.projection import (
    build_projection,
    describe,
    load_projection,
    model_rows,
    save_projection,
)
from tokenbridge.tokenizers import load_tokenizer

OUT_SCHEMES = urls.OBJECT_STORES  # --out may name one (built locally, then uploaded)


def default_out(teacher: str, student: str, k: int) -> Path:
    """outputs/projection/<teacher>__<student>__k<k>.safetensors."""
    names = [urls.name(teacher), urls.name(student), f"k{k}"]
    return jobs.default_out_dir("projection", names, suffix=".safetensors")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The job's arguments, ``out`` filled in (`default_out` unless given)."""
    ap = argparse.ArgumentParser(description="sparse vocabulary projection teacher <-> student")
    ap.add_argument("--teacher", required=True, help="teacher tokenizer or model dir, or its URL")
    ap.add_argument("--student", required=True, help="student tokenizer or model dir, or its URL")
    ap.add_argument("--k", type=int, default=8, help="entries kept per row")
    ap.add_argument("--out", default=None, help="output .safetensors")
    args = ap.parse_args(argv)
    for where in ("teacher", "student"):
        urls.check(getattr(args, where), where=f"--{where}", schemes=urls.OBJECT_STORES,
                   doing="loading a tokenizer from")  # fmt: skip
    out = urls.check(args.out, where="--out", schemes=OUT_SCHEMES, doing="writing a projection to")
    args.out = storage.location(out) if out else default_out(args.teacher, args.student, args.k)
    return args


def main(argv: list[str] | None = None) -> Path | str:
    args = parse_args(argv)
    if urls.is_url(args.out):
        storage.exists(args.out)  # refused credentials fail now, not after the build
    t0 = time.perf_counter()
    # a URL: this machine's verified copy (tokenbridge.remote_models)
    t_dir, s_dir = remote_models.local_copy(args.teacher), remote_models.local_copy(args.student)
    teacher, student = load_tokenizer(t_dir), load_tokenizer(s_dir)
    p = build_projection(
        teacher,
        student,
        k=args.k,
        teacher_rows=model_rows(t_dir),
        student_rows=model_rows(s_dir),
    )
    with tempfile.TemporaryDirectory() as tmp:
        remote = urls.is_url(args.out)
        saved = save_projection(p, Path(tmp) / urls.name(args.out) if remote else args.out)
        load_projection(saved, teacher=teacher.info(), student=student.info())  # a bad build
        if remote:
            storage.upload(saved, args.out)
    out = args.out if remote else saved
    print(f"{out}: {describe(p)} ({time.perf_counter() - t0:.1f} s)")
    return out


if __name__ == "__main__":
    sys.exit(cli.run(main, prog="projection"))
