"""`python -m trainer.eval --model DIR[,DIR2] [--tasks a,b] [--limit N] [--out results.json]`

Evaluates one or more HF model directories on the tasks (default: every likelihood task; add
``gen`` for generation, ``text:PATH`` for a text file's bits per byte), prints one Markdown table
with a column per model and the paired differences, and writes the JSON, the table as .md, and
beside them a bar chart of each task's primary metric with standard-error bars (.png) and a
self-contained page with the chart and the table (.html).
Without ``--model`` it evaluates the shipped student and teacher side by side.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from tokenbridge import cli, paths
from trainer.eval.chart import write_eval_report
from trainer.eval.loglik import ModelDoesNotFitError
from trainer.eval.results import markdown_table, timing_table, write_results
from trainer.eval.runner import evaluate_models
from trainer.eval.tasks import GROUPS, TASKS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"tasks: {', '.join(TASKS)}; groups: {', '.join(GROUPS)}; text:PATH",
    )
    ap.add_argument(
        "--model", default="", help="HF dir(s), comma-separated (default: student,teacher)"
    )
    ap.add_argument(
        "--tasks", default="default", help="comma list of tasks/groups (default: default)"
    )
    ap.add_argument("--limit", type=int, default=None, help="stable subset of N examples per task")
    ap.add_argument(
        "--out", type=Path, default=None, help="results JSON (default: outputs/eval/...)"
    )
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--batch-size", type=int, default=16, help="examples per forward")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per forward")
    ap.add_argument("--max-length", type=int, default=None, help="tokens per sequence")
    ap.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    ap.add_argument("--gen-max-tokens", type=int, default=256)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is faster on a machine others are busy on",
    )
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


# a model too big for the device: the user picks a smaller batch, dtype or device (exit 2)
RULES = (cli.Rule((ModelDoesNotFitError,), cli.EXIT_USAGE),)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv, prog="eval", rules=RULES)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    models = [m for m in args.model.split(",") if m.strip()]
    if not models:
        models = [str(paths.student_dir()), str(paths.teacher_dir())]
        print(f"no --model given: evaluating {' and '.join(models)}", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = paths.REPO_ROOT / "outputs" / "eval" / f"eval-{stamp}.json"
    payload = evaluate_models(
        models,
        args.tasks,
        device=args.device,
        dtype=args.dtype,
        limit=args.limit,
        batch_size=args.batch_size,
        batch_tokens=args.batch_tokens,
        max_length=args.max_length,
        chat=args.chat,
        gen_max_tokens=args.gen_max_tokens,
        progress=not args.no_progress,
    )
    json_path, md_path = write_results(payload, out)
    print(markdown_table(payload))
    print(timing_table(payload))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    try:
        png, page = write_eval_report(payload, json_path)
        print(f"chart: {png}; page (chart + table): {page}", file=sys.stderr)
    except Exception as e:  # the results are written; a failed chart must not hide them
        print(f"eval chart not written ({type(e).__name__}: {e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
