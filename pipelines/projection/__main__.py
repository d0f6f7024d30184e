"""The projection job: two model directories -> a sparse vocabulary projection file.

    python -m pipelines.projection --teacher T --student S [--k 8] [--out FILE]

(``make projection``). The builder and the file format are the library's
(`tokenbridge.projection`); this command loads both tokenizers, reads each lm_head's width from
its config.json, builds, writes atomically, and reads the file back as the trainer will (a bad
build is refused here, not at training time). It needs no Beam: one batched re-tokenization per
direction takes seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tokenbridge import cli, paths
from tokenbridge.projection import (
    build_projection,
    describe,
    load_projection,
    model_rows,
    save_projection,
)
from tokenbridge.tokenizers import load_tokenizer


def default_out(teacher: str, student: str, k: int) -> Path:
    name = f"{Path(teacher.rstrip('/')).name}__{Path(student.rstrip('/')).name}__k{k}"
    return paths.REPO_ROOT / "outputs" / "projection" / f"{name}.safetensors"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The job's arguments, ``out`` filled in (`default_out` unless given)."""
    ap = argparse.ArgumentParser(description="sparse vocabulary projection teacher <-> student")
    ap.add_argument("--teacher", required=True, help="teacher tokenizer or model directory")
    ap.add_argument("--student", required=True, help="student tokenizer or model directory")
    ap.add_argument("--k", type=int, default=8, help="entries kept per row")
    ap.add_argument("--out", type=Path, default=None, help="output .safetensors")
    args = ap.parse_args(argv)
    args.out = args.out or default_out(args.teacher, args.student, args.k)
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    t0 = time.perf_counter()
    teacher, student = load_tokenizer(args.teacher), load_tokenizer(args.student)
    p = build_projection(
        teacher,
        student,
        k=args.k,
        teacher_rows=model_rows(args.teacher),
        student_rows=model_rows(args.student),
    )
    out = save_projection(p, args.out)
    load_projection(out, teacher=teacher.info(), student=student.info())  # refuses a bad build
    print(f"{out}: {describe(p)} ({time.perf_counter() - t0:.1f} s)")
    return out


if __name__ == "__main__":
    sys.exit(cli.run(main, prog="projection"))
