"""What every job of ours shares around its pipeline: the output side of its config, the default
runner, the default output directory, the run checked to its COMPLETED marker, and the summary.

Beam is imported inside the functions that need it: the projection job, which runs no
pipeline, imports this module on a machine without Beam.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pipelines.plumbing import progress, rolling, storage
from pipelines.plumbing.tagged import MAX_DEAD_FRACTION, refuse_if_dead
from tokenbridge import paths, urls
from tokenbridge.formats import shard_schema

DEFAULT_RUNNER = "FnApiRunner"  # the plain DirectRunner tries to download Prism
ROLL_MB = 128  # output files roll at this size


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The output side of a job's config (each job's `JobConfig` adds its own fields)."""

    out: storage.Location  # a local directory (Path) or an object-store URL (str)
    roll_bytes: int = ROLL_MB << 20
    overwrite: bool = False
    max_dead_fraction: float = MAX_DEAD_FRACTION  # above it: exit 2, no COMPLETED


def default_runner_args(
    beam_args: list[str], *, workers: int, mode: str = "multi_processing"
) -> list[str]:
    """The FnApiRunner with `workers` workers, unless the caller chose a runner.

    ``--direct_num_workers N`` alone would run N threads in one process (the GIL allows no
    speed-up for Python work), so N > 1 comes with ``--direct_running_mode`` `mode` unless the
    caller named one (``multi_threading`` only for work that releases the GIL); one worker runs
    in this process."""
    from apache_beam.options.pipeline_options import PipelineOptions

    if any(a == "--runner" or a.startswith("--runner=") for a in beam_args):
        return beam_args
    out = ["--runner", DEFAULT_RUNNER, *beam_args]
    given = PipelineOptions(beam_args).get_all_options().get("direct_num_workers")
    if not any(a.startswith("--direct_num_workers") for a in beam_args):
        given = workers
        out += ["--direct_num_workers", str(workers)]
    if given > 1 and not any(a.startswith("--direct_running_mode") for a in beam_args):
        out += ["--direct_running_mode", mode]
    return out


def slug(path: str | os.PathLike, *, limit: int = 40) -> str:
    """The last part of a path or URL as a file name (other characters as ``-``)."""
    name = urls.name(str(path).rstrip("/"))
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:limit]


def default_out_dir(job: str, names: list[str], *, suffix: str = "") -> Path:
    """outputs/<job>/<names joined by __><suffix>: named after the inputs only, so a rerun
    lands in the same place."""
    return paths.REPO_ROOT / "outputs" / job / ("__".join(names) + suffix)


def configure_logging() -> None:
    """The jobs' log format; Beam's own records from warnings up. `force`: importing Beam
    already configured the root logger (docs/pipelines.md, "One pipeline on every runner")."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)


def run_to_completion(p, out: storage.Location, run_id: str, *, hint: str = "", **report):
    """Run pipeline `p` (progress printed, `progress.run_with_progress` with `report`), then
    check what a finished run leaves: too many dead letters is exit 2 and a run without
    COMPLETED an error. Returns the runner's result."""
    prog = rolling.progress_dir(out, run_id)
    try:
        result = progress.run_with_progress(p, prog, **report)
    finally:
        if urls.is_url(out):
            storage.rmtree(prog)  # a local directory (the run's own is removed by Finalize)
    refuse_if_dead(storage.join(out, shard_schema.STATS_FILE))
    if not storage.exists(storage.join(out, shard_schema.COMPLETED_MARKER)):
        raise RuntimeError(
            f"the pipeline finished but {out} has no COMPLETED marker"
            + (f"; {hint}" if hint else "")
        )
    return result


def summary_line(stats: dict, out: storage.Location, *, what: str) -> str:
    """One line for the end of a run: where, `what` was made, dead letters, wall time."""
    return (
        f"{out}: {what}; dead letters {stats['dead_letters']} {stats['drops_by_reason']} "
        f"({stats['wall_s']:.1f} s)"
    )
