"""The align job: raw text -> aligned Arrow shards for the trainer (``make align``).

    python -m pipelines.align_job --data 'corpus/*.txt' --teacher T [--teacher T2 ...] \\
        --student S [--out DIR] [--max-student-tokens 512] [--max-teacher-tokens 512] \\
        [--text-field text] [--txt-mode file|blocks] [--num-shards N] [--overwrite] \\
        [Beam pipeline options, e.g. --runner FnApiRunner --direct_num_workers 2 \\
         --direct_running_mode multi_processing]

The pipeline reads as its own table of contents::

    ReadDocs -> TokenizeAndAlign -> CutWindows -> WriteShards
                                        \\-> ComputeStats -> Finalize (stats.json, COMPLETED)

Every stage sends bad input to dead letters (``dead_letter.jsonl``) and counters. The last
step runs on the global combine of everything written, so ``COMPLETED`` appears only after
every shard file and the dead-letter file are in place; a crashed run leaves no marker. The
default runner is Beam's in-process ``FnApiRunner``; any other runner (Dask, Dataflow, Flink,
Spark) is chosen with the usual ``--runner`` options (``OUT`` must then be a filesystem that
every worker and this process share).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines import align_dofns as F
from pipelines import paths, readers, shards
from pipelines import schema as S
from pipelines.align import WindowConfig

log = logging.getLogger("tokenbridge.align")

DEFAULT_RUNNER = "FnApiRunner"  # the plain DirectRunner tries to download Prism
BYTES_PER_SHARD = 16 << 20  # of input text; ~5x that in Arrow (ids + chunk columns)
BYTES_PER_GROUP = 4 << 20  # of input text per tokenization group (the unit of parallelism)


def default_out_dir(data: list[str], student: str, teachers: list[str]) -> Path:
    """outputs/align/<student>__<teachers>__<data> (names only, so reruns land in one place)."""

    def slug(p: str) -> str:
        name = Path(p.rstrip("/")).name
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:40]

    data_name = slug(readers.glob_base(data[0]) or data[0])
    parts = [slug(student), "+".join(slug(t) for t in teachers), data_name]
    return paths.REPO_ROOT / "outputs" / "align" / "__".join(parts)


def match_inputs(patterns: list[str]) -> tuple[list[tuple[str, str]], int]:
    """Glob patterns -> [(path, doc id prefix)], total bytes; a pattern matching nothing is an
    error (a typo in DATA must not produce an empty, complete shard directory)."""
    found, bases, total = [], [], 0
    for pattern in patterns:
        metas = FileSystems.match([pattern])[0].metadata_list
        if not metas:
            raise FileNotFoundError(f"--data {pattern!r} matches no file")
        for m in sorted(metas, key=lambda m: m.path):
            found.append(m.path)
            bases.append(readers.glob_base(pattern))
            total += m.size_in_bytes
    ids = readers.doc_ids_for(found, bases)
    return [(p, ids[p]) for p in dict.fromkeys(found)], total


def prepare_out_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse to write over a complete run unless `overwrite`; clear what an earlier run left.

    The COMPLETED marker is removed first, so a crash during cleanup or during the new run never
    leaves a directory that looks complete."""
    marker = out / S.COMPLETED_MARKER
    if marker.exists() and not overwrite:
        raise FileExistsError(
            f"{out} already holds a complete run (it has {S.COMPLETED_MARKER}); "
            "pass --overwrite to replace it or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    stale = [*out.glob(f"*{S.SHARD_SUFFIX}"), *out.glob(".*.tmp-*")]
    stale += [out / S.STATS_FILE, out / S.DEAD_LETTER_FILE]
    for p in stale:
        if p.is_file():
            p.unlink()


def split(pcoll, tags: list[str]) -> dict:
    """(tag, value) pairs -> one PCollection of values per tag. Used instead of ParDo's
    ``with_outputs``, whose tagged outputs the DaskRunner mixes together."""
    return {tag: pcoll | f"Select_{tag}" >> beam.FlatMap(F.select, tag) for tag in tags}


class ReadDocs(beam.PTransform):
    """Files -> documents, grouped into tokenization batches. Outputs: ``batches`` (lists of
    `readers.Doc`) and ``dead_letter``."""

    def __init__(self, files: list[tuple[str, str]], *, config, num_groups: int):
        super().__init__()
        self.files, self.config, self.num_groups = files, config, num_groups

    def expand(self, pbegin):
        read = (
            pbegin
            | "Files" >> beam.Create(self.files)
            | "SpreadFiles" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(F.ReadFileDoFn(self.config))
        )
        out = split(read, [F.MAIN, F.DEAD])
        n = self.num_groups
        batches = (
            out[F.MAIN]
            | "KeyByGroup" >> beam.Map(lambda docs: (F.shard_of(docs[0].doc_id, n), docs))
            | "Group" >> beam.GroupByKey()
            | "SplitBatches" >> beam.ParDo(F.SplitBatchesDoFn())
        )
        return {"batches": batches, F.DEAD: out[F.DEAD]}


class TokenizeAndAlign(beam.PTransform):
    """Batches of docs -> lists of `AlignedDoc` (one encode_batch per tokenizer per batch)."""

    def __init__(self, student: str, teachers: list[str]):
        super().__init__()
        self.student, self.teachers = student, teachers

    def expand(self, batches):
        out = batches | "EncodeAlign" >> beam.ParDo(
            F.TokenizeAlignDoFn(self.student, self.teachers)
        )
        out = split(out, [F.MAIN, F.DEAD])
        return {"aligned": out[F.MAIN], F.DEAD: out[F.DEAD]}


class CutWindows(beam.PTransform):
    """Aligned docs -> (shard, Arrow rows of its windows); stats; uncuttable docs as dead."""

    def __init__(self, student, teachers, *, config, schema, num_shards):
        super().__init__()
        self.fn = F.CutWindowsDoFn(
            student, teachers, config=config, schema=schema, num_shards=num_shards
        )

    def expand(self, aligned):
        out = split(aligned | "Cut" >> beam.ParDo(self.fn), [F.MAIN, F.STATS, F.DEAD])
        return {"rows": out[F.MAIN], F.STATS: out[F.STATS], F.DEAD: out[F.DEAD]}


class WriteShards(beam.PTransform):
    """(shard, Arrow rows) -> one atomically written file per shard -> ("file", name, rows)."""

    def __init__(self, out_dir: str, *, schema, num_shards: int):
        super().__init__()
        self.fn = F.WriteShardDoFn(out_dir, schema=schema, num_shards=num_shards)

    def expand(self, rows):
        return rows | "GroupByShard" >> beam.GroupByKey() | "Write" >> beam.ParDo(self.fn)


class WriteDeadLetters(beam.PTransform):
    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def expand(self, dead):
        return (
            dead
            | "KeyAll" >> beam.Map(lambda r: (None, r))
            | "GroupAll" >> beam.GroupByKey()
            | "Write" >> beam.ParDo(F.WriteDeadLettersDoFn(self.out_dir))
        )


class ComputeStats(beam.PTransform):
    """Written files + per-batch stats + drops -> one summary element (a global combine, so it
    exists only once all its inputs are complete)."""

    def expand(self, parts):
        # a seed element, so the combine has input even for a run with nothing in it; and no
        # default value (CombineGlobally's default is a side input, recomputed by Dask)
        seed = parts[0].pipeline | "Seed" >> beam.Create([("stats", {})])
        return (
            (*parts, seed)
            | "Merge" >> beam.Flatten()
            | "Sum" >> beam.CombineGlobally(F.SummaryCombineFn()).without_defaults()
        )


@dataclasses.dataclass(frozen=True)
class JobConfig:
    data: list[str]
    student: str
    teachers: list[str]
    out: Path
    window: WindowConfig
    reader: readers.ReaderConfig
    num_shards: int = 0  # 0 = from the input size (BYTES_PER_SHARD), at least 1
    overwrite: bool = False


def build_pipeline(p: beam.Pipeline, cfg: JobConfig, *, files, total_bytes, infos) -> dict:
    """Assemble the job on pipeline `p` (tests call this with a TestPipeline); returns the
    main PCollections by name (dead letters, written files, final stats) for assertions."""
    student_info, teacher_infos = infos
    schema = S.shard_schema(student_info, teacher_infos)
    num_shards = cfg.num_shards or max(1, math.ceil(total_bytes / BYTES_PER_SHARD))
    num_groups = max(16, math.ceil(total_bytes / BYTES_PER_GROUP))
    out = str(cfg.out)
    header = {
        "schema_version": S.SCHEMA_VERSION,
        "student": student_info.to_json(),
        "teachers": [t.to_json() for t in teacher_infos],
        "data": list(cfg.data),
        "input_files": len(files),
        "input_bytes": int(total_bytes),
        "num_shards": num_shards,
        "window_config": dataclasses.asdict(cfg.window),
        "reader_config": dataclasses.asdict(cfg.reader),
    }
    read = p | "ReadDocs" >> ReadDocs(files, config=cfg.reader, num_groups=num_groups)
    aligned = read["batches"] | "TokenizeAndAlign" >> TokenizeAndAlign(cfg.student, cfg.teachers)
    windows = aligned["aligned"] | "CutWindows" >> CutWindows(
        cfg.student, cfg.teachers, config=cfg.window, schema=schema, num_shards=num_shards
    )
    written = windows["rows"] | "WriteShards" >> WriteShards(
        out, schema=schema, num_shards=num_shards
    )
    dead = (read[F.DEAD], aligned[F.DEAD], windows[F.DEAD]) | "AllDeadLetters" >> beam.Flatten()
    dropped = dead | "WriteDeadLetters" >> WriteDeadLetters(out)
    summary = (written, windows[F.STATS], dropped) | "ComputeStats" >> ComputeStats()
    # the last transform built: runners that compute only the final node (Dask) compute it all
    final = summary | "Finalize" >> beam.ParDo(
        F.FinalizeDoFn(out, schema=schema, num_shards=num_shards, header=header)
    )
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
        if c.key.metric.namespace == F.NAMESPACE:
            name = c.key.metric.name
            out["counters"][name] = out["counters"].get(name, 0) + int(c.committed or 0)
    for d in res.get("distributions", []):
        if d.key.metric.namespace == F.NAMESPACE and d.committed is not None:
            name = d.key.metric.name.removeprefix("stage_us.")
            prev = out["stage_us"].get(name, {"sum": 0, "count": 0})
            out["stage_us"][name] = {
                "sum": prev["sum"] + int(d.committed.sum),
                "count": prev["count"] + int(d.committed.count),
            }
    return out


def parse_args(argv: list[str] | None) -> tuple[JobConfig, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", action="append", required=True, help="glob(s) of input files")
    ap.add_argument("--teacher", action="append", required=True, help="teacher tokenizer/model")
    ap.add_argument("--student", required=True, help="student tokenizer/model")
    ap.add_argument("--out", type=Path, default=None, help="shard directory (default outputs/)")
    ap.add_argument("--max-student-tokens", type=int, default=WindowConfig.max_student_tokens)
    ap.add_argument("--max-teacher-tokens", type=int, default=WindowConfig.max_teacher_tokens)
    ap.add_argument("--stride-chars", type=int, default=None, help="window overlap (chars)")
    ap.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    ap.add_argument("--txt-mode", choices=readers.TXT_MODES, default="file")
    ap.add_argument("--num-shards", type=int, default=0, help="0 = from the input size")
    ap.add_argument("--overwrite", action="store_true", help="replace a complete earlier run")
    args, beam_args = ap.parse_known_args(argv)
    window = WindowConfig(
        max_student_tokens=args.max_student_tokens,
        max_teacher_tokens=args.max_teacher_tokens,
        stride_chars=args.stride_chars,
    )
    out = args.out or default_out_dir(args.data, args.student, args.teacher)
    cfg = JobConfig(
        data=args.data,
        student=args.student,
        teachers=args.teacher,
        out=out,
        window=window,
        reader=readers.ReaderConfig(text_field=args.text_field, txt_mode=args.txt_mode),
        num_shards=args.num_shards,
        overwrite=args.overwrite,
    )
    if not any(a == "--runner" or a.startswith("--runner=") for a in beam_args):
        beam_args = ["--runner", DEFAULT_RUNNER, *beam_args]
    return cfg, beam_args


def run(argv: list[str] | None = None) -> dict:
    """Run the job; returns the stats written to stats.json plus ``wall_s`` and ``metrics``
    (Beam counters and stage times, where the runner reports them); raises if the run failed."""
    cfg, beam_args = parse_args(argv)
    t0 = time.perf_counter()
    student = F.cached_tokenizer(cfg.student)
    teachers = [F.cached_tokenizer(t) for t in cfg.teachers]
    infos = (student.info(), [t.info() for t in teachers])
    files, total_bytes = match_inputs(cfg.data)
    prepare_out_dir(cfg.out, overwrite=cfg.overwrite)
    log.info("align: %d files, %.1f MB -> %s", len(files), total_bytes / 1e6, cfg.out)
    p = beam.Pipeline(options=PipelineOptions(beam_args))
    build_pipeline(p, cfg, files=files, total_bytes=total_bytes, infos=infos)
    result = p.run()
    try:
        result.wait_until_finish()
    finally:
        client = getattr(result, "client", None)  # DaskRunner opens its own client
        if client is not None:
            client.close()
    if not (cfg.out / S.COMPLETED_MARKER).is_file():
        raise RuntimeError(f"the pipeline finished but {cfg.out} has no COMPLETED marker")
    stats = shards.open_shards(cfg.out, student=infos[0], teachers=infos[1]).stats()
    stats["wall_s"] = time.perf_counter() - t0
    stats["metrics"] = job_metrics(result)
    return stats


def summary_line(stats: dict, out: Path) -> str:
    kinds = ", ".join(
        f"t{i}: " + " ".join(f"{k}={v}" for k, v in ck.items())
        for i, ck in enumerate(stats["chunk_kinds"])
    )
    return (
        f"{out}: {stats['documents']} documents -> {stats['windows']} windows in "
        f"{stats['shards']} shards; tokens student={stats['tokens']['student']} "
        f"teachers={stats['tokens']['teachers']}; chunks {kinds}; "
        f"fallback rate {stats['fallback_rate']}; dead letters {stats['dead_letters']} "
        f"{stats['drops_by_reason']} ({stats['wall_s']:.1f} s)"
    )


def main(argv: list[str] | None = None) -> None:
    # force: importing Beam already configured the root logger (see pipelines/__init__.py)
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    cfg, _ = parse_args(argv)
    stats = run(argv)
    print(summary_line(stats, cfg.out))
    print(json.dumps({k: stats[k] for k in ("documents", "windows", "drops_by_reason")}))


if __name__ == "__main__":
    from pipelines import cli

    sys.exit(cli.run(main, sys.argv[1:], prog="align"))
