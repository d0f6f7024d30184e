"""The teacher-cache job: aligned shards -> the teacher's outputs per position (``make teacher-cache``).

This module plans row tasks, checks the teacher and the shards before anything is written,
assembles the pipeline (ReadRows -> Score in RunInference -> WriteCache / WriteDeadLetters ->
Finalize, COMPLETED last) and runs it. The teacher runs in the workers (`handler`), or behind
an inference server they send their rows to (``--teacher-server``: `served_handler`). Options
and runners: the README's "The teacher cache"; the stages: docs/pipelines.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow.compute as pc
from apache_beam.ml.inference.base import RunInference
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.plumbing import beam_worker, jobs, rolling, storage, writers
from pipelines.plumbing.rolling import prepare_out_dir
from pipelines.plumbing.tagged import (
    DEAD,
    MAIN,
    add_dead_fraction_arg,
    dead_fraction,
    split,
)
from pipelines.teacher_cache import handler, score_dofns, served_handler
from tokenbridge import cli, remote_models, urls
from tokenbridge.formats import shard_schema, shards
from tokenbridge.formats.fingerprints import shards_fingerprint, weights_fingerprint
from tokenbridge.formats.teacher_cache import CacheMeta
from tokenbridge.formats.teacher_cache_reader import REBUILD
from tokenbridge.model_spec import ModelSpec, check_dtype, resolve_dtype
from tokenbridge.remote_cache import DEFAULT_DIR, RemoteCache, default_dir
from tokenbridge.tokenizers import load_tokenizer

log = logging.getLogger("tokenbridge.teacher_cache")

ROLL_MB = jobs.ROLL_MB  # cache files roll at this size
OUT_SCHEMES = urls.OBJECT_STORES  # --out may name one (written through Beam's S3 I/O)
# a served teacher that stopped answering: the run failed (exit 1), the server is to blame
RULES = (
    cli.Rule(
        ("tokenbridge.teacher.served.TeacherServerError",),
        hint="restart the server (make teacher-server), then run the job again",
    ),
)


@dataclass(frozen=True)
class JobConfig(jobs.JobConfig):
    """The teacher-cache job's config (``out`` and the rest of the output side: `jobs.JobConfig`)."""

    shards: Path  # local: the directory, or the verified copy of `shards_url`
    meta: CacheMeta
    teacher: ModelSpec  # the teacher model (path, init, random-init recipe)
    teacher_dtype: str = "float32"  # its weights and compute, resolved (never auto)
    batch_tokens: int = 8192  # padded teacher tokens per forward (rows x longest row)
    max_rows: int = 64
    rows_per_task: int = 512
    device: str = "cpu"
    threads: int | None = None
    shards_url: str | None = None  # --shards given as an object-store URL: workers read it
    server: served_handler.ServerSpec | None = None  # --teacher-server: scored there
    server_report: dict = field(default_factory=dict)  # its preflight's (model, context, latency)


def plan_tasks(
    shard_set: shards.ShardSet, rows_per_task: int, *, url: str | None = None
) -> list[score_dofns.RowTask]:
    """Row ranges of every shard file, `rows_per_task` rows each (the unit a worker reads).
    With `url` (the shards in an object store) a task names the object and its checksum: a
    worker on another machine reads it from there, and refuses it if it changed."""
    sums = shard_set.checksums if url else {}
    return [
        score_dofns.RowTask(
            urls.join(url, path.name) if url else str(path),
            a,
            min(a + rows_per_task, n),
            expected=sums.get(path.name),
        )  # fmt: skip
        for path, n in zip(shard_set.files, shard_set.file_rows)
        for a in range(0, n, rows_per_task)
    ]


class ReadRows(beam.PTransform):
    """Row tasks -> token-bounded `RowBatch`es (MAIN) and bad rows (DEAD)."""

    def __init__(self, tasks: list[score_dofns.RowTask], cfg: JobConfig):
        super().__init__()
        self.tasks = tasks
        self.fn = score_dofns.ReadRowBatchesDoFn(
            teacher_index=int(cfg.meta.shards["teacher_index"]),
            vocab_size=int(cfg.meta.teacher["vocab_size"]),
            budget=cfg.batch_tokens,
            max_rows=cfg.max_rows,
        )

    def expand(self, pbegin):
        # Create spreads the tasks (row ranges, not rows) over the workers
        read = pbegin | "Tasks" >> beam.Create(self.tasks) | "Read" >> beam.ParDo(self.fn)
        return split(read, [MAIN, DEAD])


class Score(beam.PTransform):
    """`RowBatch` -> the teacher (RunInference) -> `ScoredBatch` (MAIN), failed rows (DEAD)."""

    def __init__(self, model_handler: handler.RowBatchHandler):
        super().__init__()
        self.handler = model_handler

    def expand(self, batches):
        scored = batches | "RunInference" >> RunInference(self.handler)
        return split(scored | "Check" >> beam.FlatMap(score_dofns.split_scored), [MAIN, DEAD])


def build_pipeline(p: beam.Pipeline, cfg: JobConfig, *, tasks, run_id: str, header: dict) -> dict:
    """Assemble the job on `p`; returns the main PCollections by name (tests assert on them)."""
    tmp = str(rolling.run_dir(cfg.out, run_id))
    prog = rolling.progress_dir(cfg.out, run_id)
    meta = cfg.meta
    spec = handler.teacher_spec(
        int(meta.teacher["vocab_size"]), k=meta.k, temperature=meta.temperature, target=meta.target
    )
    if cfg.server is not None:
        model_handler = served_handler.ServedCacheHandler(cfg.server, spec)
    else:
        model_handler = handler.TeacherCacheHandler(
            cfg.teacher,
            spec,
            dtype=cfg.teacher_dtype,
            device=cfg.device,
            threads=cfg.threads,
            samples=meta.samples,
            sample_seed=meta.sample_seed,
        )
    read = p | "ReadRows" >> ReadRows(tasks, cfg)
    scored = read[MAIN] | "Score" >> Score(model_handler)
    written = scored[MAIN] | "WriteCache" >> beam.ParDo(
        score_dofns.WriteCacheDoFn(tmp, meta=meta, roll_bytes=cfg.roll_bytes, progress_dir=prog)
    )
    dead = (read[DEAD], scored[DEAD]) | "AllDeadLetters" >> beam.Flatten()
    dropped = dead | "WriteDeadLetters" >> beam.ParDo(
        writers.WriteDeadLettersDoFn(tmp, roll_bytes=cfg.roll_bytes)
    )
    seed = p | "Seed" >> beam.Create([("stats", None)])
    summary = (
        (written, dropped, seed)
        | "Merge" >> beam.Flatten()
        | "Sum" >> beam.CombineGlobally(writers.SummaryCombineFn()).without_defaults()
    )
    fn = score_dofns.FinalizeCacheDoFn(
        str(cfg.out), tmp, meta=meta, header=header, max_dead_fraction=cfg.max_dead_fraction
    )
    final = summary | "Finalize" >> beam.ParDo(fn)
    return {"dead_letters": dead, "written": written, "stats": final}


def _progress_line(totals: dict, *, total: int, elapsed: float) -> str:
    done = min(totals["bytes"], total)
    rate = totals["tokens"] / elapsed if elapsed > 0 else 0.0
    eta = f"{elapsed * (total - done) / done:.0f} s" if done else "?"
    return (
        f"teacher-cache: {done:,}/{total:,} teacher tokens ({done / max(total, 1):.0%}), "
        f"{totals['documents']:,} rows, {rate:,.0f} tokens/s, ETA {eta}"
    )


def default_out_dir(shards_name: str, teacher: str, k: int) -> Path:
    """outputs/teacher_cache/<shards>__<teacher>__k<k>: `shards_name` is the shard directory's
    name (the last part of its URL for shards in a store)."""
    return jobs.default_out_dir("teacher_cache", [shards_name, urls.name(teacher), f"k{k}"])


def _teacher_index(shard_set: shards.ShardSet, fingerprint: str, given: int | None) -> int:
    """Which teacher column of the shards TEACHER's tokenizer made (refused if none / unclear)."""
    found = [i for i, t in enumerate(shard_set.meta.teachers) if t.fingerprint == fingerprint]
    names = [t.name for t in shard_set.meta.teachers]
    if given is not None:
        if given not in found:
            raise ValueError(
                f"--teacher-index {given}: the shards' teacher {given} was tokenized with another "
                f"tokenizer than --teacher's (shard teachers: {names})"
            )
        return given
    if not found:
        raise ValueError(
            f"{shard_set.dir}: no teacher column was made with --teacher's tokenizer (shard "
            f"teachers: {names}); align the data with this teacher first (make align)"
        )
    if len(found) > 1:
        raise ValueError(
            f"teachers {found} of the shards share this tokenizer: pass --teacher-index"
        )
    return found[0]


def check_samples(samples: int, *, student, teacher) -> None:
    """Sampled ids are the teacher's, usable as targets only where the student shares its
    tokenizer (sampled KD): refused for any other teacher (`TokenizerInfo`s)."""
    if samples and student.fingerprint != teacher.fingerprint:
        raise ValueError(
            f"--samples {samples}: the teacher's tokenizer ({teacher.name}) is not the student's "
            f"({student.name}), so its sampled ids are no targets for the student; sampled KD "
            "needs a same-tokenizer teacher (drop --samples: xtoken reads the top-k and tail)"
        )


def configure(argv: list[str] | None) -> tuple[JobConfig, list[str]]:
    """Arguments -> the job's config, checked against the shards and the teacher's tokenizer and
    weights (which are hashed here: the fingerprint the trainer will compare)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", required=True, help="aligned shard directory (or s3:// URL)")
    ap.add_argument(
        "--cache-dir",
        default=None,
        help=f"where this process copies --shards / --teacher s3://... (default {DEFAULT_DIR}; "
        "workers use their machine's ~/.cache/tokenbridge)",
    )
    ap.add_argument("--cache-limit-gb", type=float, default=50.0,
                    help="size limit of --cache-dir (least recently used copies evicted)")  # fmt: skip
    ap.add_argument("--teacher", required=True, help="teacher model directory (HF) or its URL")
    ap.add_argument("--k", type=int, default=32, help="top-k stored per position")
    ap.add_argument("--temperature", type=float, default=1.0, help="as loss.temperature")
    ap.add_argument(
        "--logprob-dtype", default="float16", choices=("float16", "bfloat16", "float32")
    )
    ap.add_argument("--no-target", action="store_true", help="do not store target log-probs")
    ap.add_argument("--samples", type=int, default=0, help="R ids drawn per position (<= 255)")
    ap.add_argument("--sample-seed", type=int, default=0)
    ap.add_argument("--teacher-index", type=int, default=None, help="teacher column of the shards")
    ap.add_argument(
        "--teacher-dtype",
        default="auto",
        help="as teachers[i].dtype (auto: bfloat16 on a CUDA --device, else float32)",
    )
    ap.add_argument("--init", default="pretrained", choices=("pretrained", "random"))
    ap.add_argument("--seed", type=int, default=0, help="random init seed (as teachers[i].seed)")
    ap.add_argument("--override", action="append", default=[], help="key=json (random init)")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="rows x longest row per forward")
    ap.add_argument("--max-rows", type=int, default=64, help="rows per forward at most")
    ap.add_argument("--rows-per-task", type=int, default=512)
    ap.add_argument("--cache-mb", type=float, default=ROLL_MB, help="cache files roll at this")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    ap.add_argument("--out", default=None)
    ap.add_argument("--overwrite", action="store_true", help="replace a complete earlier run")
    add_dead_fraction_arg(ap)
    served_handler.add_server_args(ap)
    args, beam_args = ap.parse_known_args(argv)
    # what a server cannot give is refused before anything is fetched or hashed
    server = served_handler.server_spec(args, name=urls.name(args.teacher))
    urls.check(args.teacher, where="--teacher", schemes=urls.OBJECT_STORES,
               doing="loading a model from")  # fmt: skip
    shards_url = urls.check(args.shards, where="--shards", schemes=urls.OBJECT_STORES,
                            doing="reading shards from")  # fmt: skip
    cache = RemoteCache(args.cache_dir or default_dir(),
                        limit_bytes=int(args.cache_limit_gb * 1e9), local_rank=0)  # fmt: skip
    # a teacher at a URL: checked here on this machine's verified copy (tokenizer, lm_head,
    # weights' fingerprint); each worker fetches its own copy (the handler's load_model)
    teacher_dir = (
        str(remote_models.fetch(cache, args.teacher)) if urls.is_url(args.teacher) else args.teacher
    )
    if urls.is_url(shards_url):
        # the launcher plans on a verified local copy; the workers read the objects themselves
        args.shards = cache.fetch_dir(shards_url)
    else:
        args.shards, shards_url = urls.local(shards_url), None
    out = urls.check(args.out, where="--out", schemes=OUT_SCHEMES, doing="writing a cache to")
    overrides = {}
    for item in args.override:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    teacher = handler.teacher_config(
        args.teacher, init=args.init, seed=args.seed, overrides=overrides
    )
    local = dataclasses.replace(teacher, path=teacher_dir)
    # auto resolved by --device, as the trainer resolves it by its device: the cache records
    # the dtype the teacher ran in, which a run's teachers[i].dtype must resolve to
    dtype = resolve_dtype(
        check_dtype(args.teacher_dtype, "--teacher-dtype", auto=True), args.device
    )
    shard_set = shards.open_shards(args.shards)
    tok = load_tokenizer(teacher_dir)
    if handler.lm_head_rows(local) < tok.vocab_size:
        raise ValueError(f"{args.teacher}: lm_head narrower than its tokenizer ({tok.vocab_size})")
    index = _teacher_index(shard_set, tok.fingerprint, args.teacher_index)
    check_samples(args.samples, student=shard_set.meta.student, teacher=tok.info())
    report = {}
    if server is not None:  # the trainer's preflight of a served teacher, for this column
        column = shard_schema.teacher_ids_column(index)
        longest = max(_list_lengths(shard_set, column, pc.max), default=0)
        report = served_handler.check(server, tok, k=args.k, max_len=int(longest))
    weights = weights_fingerprint(teacher_dir, init=args.init, seed=args.seed, overrides=overrides)
    meta = CacheMeta(
        teacher={
            "name": teacher.name,
            "weights": weights,
            "tokenizer": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "dtype": dtype,
        },
        shards={
            "fingerprint": shards_fingerprint(shard_set),
            "teacher_index": index,
            "files": {p.name: int(n) for p, n in zip(shard_set.files, shard_set.file_rows)},
        },
        k=args.k,
        temperature=args.temperature,
        logprob_dtype=args.logprob_dtype,
        target=not args.no_target,
        samples=args.samples,
        sample_seed=args.sample_seed,
    )
    name = urls.name(shards_url) if shards_url else args.shards.resolve().name
    out = storage.location(out) if out else default_out_dir(name, args.teacher, args.k)
    if not urls.is_url(out) and out.resolve() == args.shards.resolve():
        raise ValueError(f"--out {out} is the shard directory: choose another")
    cfg = JobConfig(
        shards=args.shards,
        out=out,
        meta=meta,
        teacher=teacher,
        teacher_dtype=dtype,
        batch_tokens=args.batch_tokens,
        max_rows=args.max_rows,
        rows_per_task=args.rows_per_task,
        roll_bytes=max(int(args.cache_mb * (1 << 20)), 1),
        device=args.device,
        threads=args.threads,
        overwrite=args.overwrite,
        max_dead_fraction=dead_fraction(args),
        shards_url=shards_url,
        server=server,
        server_report=report,
    )
    # in this process by default: torch's threads already use every core, and each worker
    # process would hold its own copy of the weights
    return cfg, storage.beam_args(jobs.default_runner_args(beam_args, workers=1))


def run(argv: list[str] | None = None) -> dict:
    """Run the job; returns stats.json's content plus ``launch_s`` (arguments, tokenizer, hash)."""
    t0 = time.perf_counter()
    cfg, beam_args = configure(argv)
    shard_set = shards.open_shards(cfg.shards)
    tasks = plan_tasks(shard_set, cfg.rows_per_task, url=cfg.shards_url)
    col = f"teacher{cfg.meta.shards['teacher_index']}_ids"
    total = sum(int(x) for x in _list_lengths(shard_set, col, pc.sum))
    prepare_out_dir(cfg.out, overwrite=cfg.overwrite)
    run_id = uuid.uuid4().hex[:12]
    header = {
        "out": str(cfg.out),
        "shards_dir": cfg.shards_url or str(cfg.shards.resolve()),
        "teacher_path": str(cfg.teacher.path),
        "batch_tokens": cfg.batch_tokens,
        "device": cfg.device,
        "started": time.time(),
    }
    if cfg.server is not None:  # the served teacher's preflight report: url, model, context
        header["teacher_server"] = cfg.server_report
    log.info("teacher-cache: %d rows, %d teacher tokens -> %s", shard_set.num_rows, total, cfg.out)
    launch_s = time.perf_counter() - t0
    p = beam.Pipeline(runner=beam_worker.runner_for(beam_args), options=PipelineOptions(beam_args))
    build_pipeline(p, cfg, tasks=tasks, run_id=run_id, header=header)

    def line(totals: dict, *, elapsed: float) -> str:
        return _progress_line(totals, total=total, elapsed=elapsed)

    jobs.run_to_completion(p, cfg.out, run_id, hint=REBUILD, total_bytes=total,
                           label="teacher-cache", line=line)  # fmt: skip
    stats = rolling.read_json(storage.join(cfg.out, "stats.json"))
    stats["launch_s"] = launch_s
    return stats


def _list_lengths(shard_set: shards.ShardSet, column: str, reduce):
    """`reduce` (pc.sum, pc.max) of the lengths of `column`'s lists, per record batch."""
    for batch in shard_set.iter_batches():
        yield np.asarray(reduce(pc.list_value_length(batch.column(column))).as_py() or 0)


def summary_line(stats: dict, out: storage.Location) -> str:
    """`jobs.summary_line` of a cache run: rows, teacher tokens, bytes and tokens per second."""
    c = stats["cache"]
    what = (
        f"{stats['rows']} rows, {stats['teacher_tokens']} teacher tokens, k={c['k']} "
        f"{c['logprob_dtype']}, {stats['bytes_per_token']:.1f} bytes/token, "
        f"{stats['teacher_tokens_per_s']:.0f} teacher tokens/s"
    )
    return jobs.summary_line(stats, out, what=what)


def main(argv: list[str] | None = None) -> None:
    jobs.configure_logging()
    stats = run(argv)
    print(summary_line(stats, stats["out"]))


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:], prog="teacher_cache", rules=RULES))
