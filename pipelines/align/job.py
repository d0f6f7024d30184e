"""The align job: raw text or conversations -> aligned Arrow shards for the trainer (``make align``).

This module lists the input, assembles the pipeline (ReadDocs -> AlignWindows -> WriteShards /
WriteDeadLetters -> Finalize, COMPLETED last) and runs it. Options and runners: the README's
"The align job" and "Distil on conversations"; the stages: docs/pipelines.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.align import align_dofns, chat_dofns, readers, worker_state, write_dofns
from pipelines.align.chat_read import peek_format
from pipelines.plumbing import beam_worker, jobs, rolling, storage, writers
from pipelines.plumbing.rolling import prepare_out_dir
from pipelines.plumbing.tagged import (
    DEAD,
    MAIN,
    NAMESPACE,
    add_dead_fraction_arg,
    dead_fraction,
    split,
)
from tokenbridge import remote_models, urls
from tokenbridge.alignment import WindowConfig
from tokenbridge.alignment.long_documents import PieceConfig
from tokenbridge.chat import fit
from tokenbridge.chat import rows as chat_rows
from tokenbridge.chat.templates import resolve_template
from tokenbridge.formats import shard_schema, shards

log = logging.getLogger("tokenbridge.align")

DEFAULT_RUNNER = jobs.DEFAULT_RUNNER
ROLL_MB = jobs.ROLL_MB  # shard files roll at this size (Arrow bytes)
SPLIT_MIN, SPLIT_MAX = 1 << 18, 64 << 20  # byte ranges of large jsonl files, per read task
OUT_SCHEMES = urls.OBJECT_STORES  # --out may name one (written through Beam's FileSystems)
# A text job's workers are threads of this process up to this many of them: the work is in
# Rust (tokenizers) and Numba kernels, which release the GIL, so threads share one parse of
# each tokenizer and one copy of its tables where processes each parse their own and compete
# for the caches (2 cores, ~300-character documents: 0.65x the CPU seconds and 0.7x the wall
# time of two processes). The GIL-held rest (~15%: reading, ids, Arrow) caps threads beyond.
# Conversations (templates rendered in Python) keep processes.
THREAD_WORKERS_UP_TO = 4
SPLITS_PER_RUN = 64  # aim for this many read tasks: dealt round-robin, even to 16 workers
MODEL_SCHEMES = urls.OBJECT_STORES  # tokenizers may be marked directories in a store


def default_out_dir(data: list[str], student: str, teachers: list[str]) -> Path:
    """outputs/align/<student>__<teachers>__<data>."""
    data_name = jobs.slug(readers.glob_base(data[0]) or data[0])
    parts = [jobs.slug(student), "+".join(jobs.slug(t) for t in teachers), data_name]
    return jobs.default_out_dir("align", parts)


def match_inputs(
    patterns: list[str], *, split_bytes: int | None = None
) -> tuple[list[align_dofns.InputSplit], int, int]:
    """Glob patterns -> (read tasks, total bytes, files). A large uncompressed local jsonl file
    becomes byte-range tasks of `split_bytes` (default: about 1/64 of the input, 256 KB-64 MB). A
    pattern matching nothing is an error (a typo in DATA must not produce an empty, complete
    shard directory)."""
    found, bases, sizes = [], [], {}
    for pattern in patterns:
        metas = FileSystems.match([pattern])[0].metadata_list
        if not metas:
            raise FileNotFoundError(f"--data {pattern!r} matches no file")
        for m in sorted(metas, key=lambda m: m.path):
            if m.path not in sizes:
                found.append(m.path)
                bases.append(readers.glob_base(pattern))
                sizes[m.path] = m.size_in_bytes
    ids = readers.doc_ids_for(found, bases)
    total = sum(sizes.values())
    split_bytes = split_bytes or min(max(total // SPLITS_PER_RUN, SPLIT_MIN), SPLIT_MAX)
    tasks = []
    for path in found:
        size = sizes[path]
        splits = (
            readers.plan_splits(path, size, split_bytes)
            if readers.splittable(path)
            else [readers.Split()]
        )
        for sp in splits:
            end = size if sp.end is None else sp.end
            tasks.append(align_dofns.InputSplit(path, ids[path], sp, end - sp.start))
    return tasks, total, len(found)


class ReadDocs(beam.PTransform):
    """Read tasks -> `DocBatch` elements (conversation jobs: `RowBatch`) (``batches``) and
    ``dead_letter`` records."""

    def __init__(
        self, tasks: list[align_dofns.InputSplit], *, cfg: JobConfig, progress_dir: str | None
    ):
        super().__init__()
        self.tasks = tasks
        if cfg.chat is None:
            self.fn = align_dofns.ReadSplitDoFn(cfg.reader, progress_dir=progress_dir)
        else:  # conversation rows (`RowBatch` elements)
            self.fn = chat_dofns.ReadChatDoFn(cfg.chat.row_format, progress_dir=progress_dir)

    def expand(self, pbegin):
        # Create spreads the tasks (file names and byte ranges, not rows) over the workers
        tasks = pbegin | "Files" >> beam.Create(self.tasks)
        read = tasks | "Read" >> beam.ParDo(self.fn)
        out = split(read, [MAIN, DEAD])
        return {"batches": out[MAIN], DEAD: out[DEAD]}


class AlignWindows(beam.PTransform):
    """`DocBatch` -> `Windows` (tokenize, align, cut, Arrow rows) and ``dead_letter``; for a
    conversation job `RowBatch` -> `Windows` (render, align, fit, Arrow rows)."""

    def __init__(self, cfg: JobConfig, *, progress_dir: str | None):
        super().__init__()
        if cfg.chat is not None:  # one row per conversation, no window cutting
            self.fn = chat_dofns.AlignChatDoFn(
                cfg.student,
                cfg.teachers,
                chat=cfg.chat,
                window=cfg.window,
                progress_dir=progress_dir,
            )
            return
        self.fn = align_dofns.AlignWindowsDoFn(
            cfg.student,
            cfg.teachers,
            window=cfg.window,
            pieces=cfg.pieces,
            progress_dir=progress_dir,
        )

    def expand(self, batches):
        out = split(batches | "AlignCut" >> beam.ParDo(self.fn), [MAIN, DEAD])
        return {"windows": out[MAIN], DEAD: out[DEAD]}


class WriteShards(beam.PTransform):
    """`Windows` -> rolling Arrow parts -> one record per batch written."""

    def __init__(self, tmp_dir: str, *, roll_bytes: int):
        super().__init__()
        self.fn = write_dofns.WriteShardsDoFn(tmp_dir, roll_bytes=roll_bytes)

    def expand(self, windows):
        return windows | "Write" >> beam.ParDo(self.fn)


class WriteDeadLetters(beam.PTransform):
    """Dead-letter records -> rolling jsonl parts -> one record per dead letter."""

    def __init__(self, tmp_dir: str, *, roll_bytes: int):
        super().__init__()
        self.fn = writers.WriteDeadLettersDoFn(tmp_dir, roll_bytes=roll_bytes)

    def expand(self, dead):
        return dead | "Write" >> beam.ParDo(self.fn)


class Finalize(beam.PTransform):
    """Records of everything written -> one summary (a global combine, so it exists only once
    all its inputs are complete) -> parts in place, stats.json, COMPLETED -> the stats."""

    def __init__(self, fn: write_dofns.FinalizeDoFn):
        super().__init__()
        self.fn = fn

    def expand(self, records):
        # a seed element, so the combine has input even for a run with nothing in it; and no
        # default value (CombineGlobally's default is a side input, recomputed by Dask)
        seed = records[0].pipeline | "Seed" >> beam.Create([("stats", None)])
        summary = (
            (*records, seed)
            | "Merge" >> beam.Flatten()
            | "Sum" >> beam.CombineGlobally(writers.SummaryCombineFn()).without_defaults()
        )
        return summary | "Publish" >> beam.ParDo(self.fn)


@dataclass(frozen=True)
class JobConfig(jobs.JobConfig):
    """The align job's config (``out`` and the rest of the output side: `jobs.JobConfig`)."""

    data: list[str]
    student: str
    teachers: list[str]
    window: WindowConfig
    reader: readers.ReaderConfig
    pieces: PieceConfig = PieceConfig()
    chat: chat_dofns.ChatConfig | None = None  # a conversation job


def build_pipeline(
    p: beam.Pipeline, cfg: JobConfig, *, tasks, total_bytes: int, input_files: int, run_id: str
) -> dict:
    """Assemble the job on pipeline `p` (tests call this with a TestPipeline); returns the
    main PCollections by name (dead letters, written records, final stats) for assertions."""
    out = str(cfg.out)
    tmp = str(rolling.run_dir(cfg.out, run_id))
    prog = rolling.progress_dir(cfg.out, run_id)
    header = write_dofns.header_for(cfg, input_files=input_files, input_bytes=total_bytes)
    read = p | "ReadDocs" >> ReadDocs(tasks, cfg=cfg, progress_dir=prog)
    aligned = read["batches"] | "AlignWindows" >> AlignWindows(cfg, progress_dir=prog)
    written = aligned["windows"] | "WriteShards" >> WriteShards(tmp, roll_bytes=cfg.roll_bytes)
    dead = (read[DEAD], aligned[DEAD]) | "AllDeadLetters" >> beam.Flatten()
    dropped = dead | "WriteDeadLetters" >> WriteDeadLetters(tmp, roll_bytes=cfg.roll_bytes)
    # the last transform built: runners that compute only the final node (Dask) compute it all
    fn = write_dofns.FinalizeDoFn(
        out,
        tmp,
        header=header,
        student=cfg.student,
        teachers=cfg.teachers,
        max_dead_fraction=cfg.max_dead_fraction,
    )
    final = (written, dropped) | "Finalize" >> Finalize(fn)
    return {"dead_letters": dead, "written": written, "stats": final}


def job_metrics(result) -> dict:
    """Counters and stage-time distributions of a finished run ({} where the runner keeps
    none, e.g. Dask)."""
    try:
        res = result.metrics().query()
    except (NotImplementedError, AttributeError):
        return {}
    out: dict = {"counters": {}, "stage_us": {}}
    for c in res.get("counters", []):
        if c.key.metric.namespace == NAMESPACE:
            name = c.key.metric.name
            out["counters"][name] = out["counters"].get(name, 0) + int(c.committed or 0)
    for d in res.get("distributions", []):
        if d.key.metric.namespace == NAMESPACE and d.committed is not None:
            name = d.key.metric.name.removeprefix("stage_us.")
            prev = out["stage_us"].get(name, {"sum": 0, "count": 0})
            out["stage_us"][name] = {
                "sum": prev["sum"] + int(d.committed.sum),
                "count": prev["count"] + int(d.committed.count),
            }
    return out


def default_runner_args(
    beam_args: list[str], cores: int | None = None, *, chat: bool = False
) -> list[str]:
    """The FnApiRunner with one worker per core (`jobs.default_runner_args`): threads of this
    process for a text job of up to THREAD_WORKERS_UP_TO workers, else processes."""
    from apache_beam.options.pipeline_options import PipelineOptions

    workers = cores or len(os.sched_getaffinity(0))
    given = workers
    if any(a.startswith("--direct_num_workers") for a in beam_args):
        given = PipelineOptions(beam_args).get_all_options()["direct_num_workers"] or workers
    threads = not chat and given <= THREAD_WORKERS_UP_TO
    mode = "multi_threading" if threads else "multi_processing"
    return jobs.default_runner_args(beam_args, workers=workers, mode=mode)


def parse_args(argv: list[str] | None) -> tuple[JobConfig, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", action="append", required=True, help="glob(s) of input files")
    ap.add_argument("--teacher", action="append", required=True, help="teacher tokenizer/model")
    ap.add_argument("--student", required=True, help="student tokenizer/model")
    ap.add_argument("--out", default=None, help="shard directory (default outputs/)")
    ap.add_argument("--max-student-tokens", type=int, default=WindowConfig.max_student_tokens)
    ap.add_argument("--max-teacher-tokens", type=int, default=WindowConfig.max_teacher_tokens)
    ap.add_argument("--stride-chars", type=int, default=None, help="window overlap (chars)")
    ap.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    ap.add_argument("--txt-mode", choices=readers.TXT_MODES, default="file")
    ap.add_argument("--shard-mb", type=float, default=ROLL_MB, help="shard files roll at this")
    ap.add_argument(
        "--piece-chars",
        type=int,
        default=PieceConfig.piece_chars,
        help="documents longer than this go in pieces",
    )
    ap.add_argument(
        "--piece-overlap",
        type=int,
        default=PieceConfig.overlap_chars,
        help="context (chars) each side of a piece seam",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace a complete earlier run")
    add_dead_fraction_arg(ap)
    chat = ap.add_argument_group("conversations")
    chat.add_argument(
        "--row-format",
        choices=("auto", chat_rows.TEXT, chat_rows.MESSAGES, chat_rows.PROMPT_COMPLETION),
        default="auto",
        help="auto: from the first record of the first file (conversations: per file)",
    )
    chat.add_argument("--chat-template", default=None, help="student's: a shipped name or .jinja")
    chat.add_argument(
        "--teacher-chat-template",
        action="append",
        default=[],
        help="once per --teacher, in order ('own' = the model's template)",
    )
    chat.add_argument(
        "--train-on", choices=chat_rows.TRAIN_MODES, default=chat_rows.TRAIN_ASSISTANT
    )
    chat.add_argument("--long-conversations", choices=fit.OVERFLOW_MODES, default=fit.TOO_LONG)
    args, beam_args = ap.parse_known_args(argv)
    # first: the input is listed (row format, read tasks) through FileSystems, in this process
    beam_args = storage.beam_args(beam_args)
    for i, model in enumerate([args.student, *args.teacher]):
        where = "--student" if i == 0 else "--teacher"
        urls.check(model, where=where, schemes=MODEL_SCHEMES, doing="loading a tokenizer from")
    out = urls.check(args.out, where="--out", schemes=OUT_SCHEMES, doing="writing shards to")
    window = WindowConfig(
        max_student_tokens=args.max_student_tokens,
        max_teacher_tokens=args.max_teacher_tokens,
        stride_chars=args.stride_chars,
    )
    out = storage.location(out) if out else default_out_dir(args.data, args.student, args.teacher)
    cfg = JobConfig(
        data=args.data,
        student=args.student,
        teachers=args.teacher,
        out=out,
        window=window,
        reader=readers.ReaderConfig(text_field=args.text_field, txt_mode=args.txt_mode),
        pieces=PieceConfig(piece_chars=args.piece_chars, overlap_chars=args.piece_overlap),
        roll_bytes=max(int(args.shard_mb * (1 << 20)), 1),
        overwrite=args.overwrite,
        max_dead_fraction=dead_fraction(args),
        chat=chat_config(args),
    )
    return cfg, default_runner_args(beam_args, chat=cfg.chat is not None)


def job_row_format(data: list[str]) -> str:
    """The row format of a job from the first record of its first file: ``text`` unless that
    record is a conversation (a glob matching nothing is left to `match_inputs` to report)."""
    for pattern in data:
        metas = FileSystems.match([pattern])[0].metadata_list
        if metas:
            first = min(metas, key=lambda m: m.path).path
            return peek_format(first) or chat_rows.TEXT
    return chat_rows.TEXT


def chat_config(args) -> chat_dofns.ChatConfig | None:
    """The conversation part of the job, or None for a text job. Templates are resolved here,
    before any worker starts: a model without one and no template named is an error now."""
    fmt = args.row_format if args.row_format != "auto" else job_row_format(args.data)
    named = args.chat_template is not None or args.teacher_chat_template
    if fmt == chat_rows.TEXT:
        if named:
            raise ValueError(
                "--chat-template / --teacher-chat-template given, but the rows are text "
                f"(--row-format {args.row_format}); conversations are 'messages' or "
                "'prompt' + 'completion' rows"
            )
        return None
    overrides = list(args.teacher_chat_template) or ["own"] * len(args.teacher)
    if len(overrides) != len(args.teacher):
        raise ValueError(
            f"--teacher-chat-template given {len(overrides)} times for {len(args.teacher)} "
            "teachers: give it once per --teacher, in order ('own' = the model's template)"
        )

    def template(model: str, override: str | None, who: str):
        try:
            return resolve_template(
                remote_models.local_copy(model), override=None if override == "own" else override
            )
        except ValueError as e:
            flag = "--chat-template" if who == "student" else "--teacher-chat-template"
            raise ValueError(f"{who}: {e} ({flag})") from None

    return chat_dofns.ChatConfig(
        student_template=template(args.student, args.chat_template, "student"),
        teacher_templates=tuple(
            template(t, o, f"teacher {i}") for i, (t, o) in enumerate(zip(args.teacher, overrides))
        ),
        row_format=None if args.row_format == "auto" else fmt,
        train_on=args.train_on,
        long_conversations=args.long_conversations,
    )


def run(argv: list[str] | None = None) -> dict:
    """Run the job; returns the stats written to stats.json plus ``wall_s`` and ``metrics``
    (Beam counters and stage times, where the runner reports them); raises if the run failed.

    The tokenizers are loaded by the workers only (this process would hold a third copy)."""
    cfg, beam_args = parse_args(argv)
    t0 = time.perf_counter()
    for path in [cfg.student, *cfg.teachers]:
        if urls.is_url(path):  # fetched and verified here too: a bad URL is one line, now
            remote_models.local_copy(path)
        elif not Path(path).exists():
            raise FileNotFoundError(f"tokenizer {path!r} does not exist")
    tasks, total_bytes, n_files = match_inputs(cfg.data)
    prepare_out_dir(cfg.out, overwrite=cfg.overwrite)
    run_id = uuid.uuid4().hex[:12]
    log.info("align: %d files, %.1f MB -> %s", n_files, total_bytes / 1e6, cfg.out)
    # FnApiRunner: its worker processes start without their chatter (pipelines.plumbing.beam_worker)
    p = beam.Pipeline(runner=beam_worker.runner_for(beam_args), options=PipelineOptions(beam_args))
    build_pipeline(p, cfg, tasks=tasks, total_bytes=total_bytes, input_files=n_files, run_id=run_id)
    # the modules imported by now stay for the run: out of the collector's scans (the threads
    # runner's workers are this process; each worker's setup freezes what it loads)
    with worker_state.settled_while_running():
        result = jobs.run_to_completion(p, cfg.out, run_id, total_bytes=total_bytes)
    if urls.is_url(cfg.out):
        stats = rolling.read_json(storage.join(cfg.out, shard_schema.STATS_FILE))
    else:
        stats = shards.open_shards(cfg.out).stats()
    stats["wall_s"] = time.perf_counter() - t0
    stats["metrics"] = job_metrics(result)
    return stats


def summary_line(stats: dict, out: storage.Location) -> str:
    """`jobs.summary_line` of an align run: documents, windows, tokens, chunk kinds."""
    kinds = ", ".join(
        f"t{i}: " + " ".join(f"{k}={v}" for k, v in ck.items())
        for i, ck in enumerate(stats["chunk_kinds"])
    )
    chat = stats.get("chat")
    if chat is not None:
        kinds += (
            f"; conversations {chat['conversations']} ({chat['truncated_conversations']} "
            f"truncated), trained tokens {chat['trained_tokens']}, end-of-turn pairs "
            f"{chat['eot_pairs']}, loose tokens {chat['loose_tokens']}, contents by edge "
            f"whitespace left out {chat['content_rewrites']}"
        )
    what = (
        f"{stats['documents']} documents -> {stats['windows']} windows in "
        f"{stats['shards']} shards; tokens student={stats['tokens']['student']} "
        f"teachers={stats['tokens']['teachers']}; chunks {kinds}; "
        f"fallback rate {stats['fallback_rate']}"
    )
    return jobs.summary_line(stats, out, what=what)


def main(argv: list[str] | None = None) -> None:
    jobs.configure_logging()
    cfg, _ = parse_args(argv)
    stats = run(argv)
    print(summary_line(stats, cfg.out))
    print(json.dumps({k: stats[k] for k in ("documents", "windows", "drops_by_reason")}))


if __name__ == "__main__":
    from tokenbridge import cli

    sys.exit(cli.run(main, sys.argv[1:], prog="align"))
