"""Beam's local worker processes (`pipelines.plumbing.beam_worker`): quiet at start, warnings still said.

A two-process FnApiRunner pipeline, run as a user runs a job (a subprocess, the jobs' logging),
whose only step logs a warning in a worker: stderr holds that warning once (relayed by the
runner) and none of the start-up chatter Beam's own worker command printed (its GCP-client
warning, its INFO lines, its semi_persistent_directory warning). The jobs' own runs on worker
processes are in test_align_scale.py (killed and re-run with two workers).
"""

from __future__ import annotations

import subprocess
import sys

from tokenbridge import paths

# the package first, as every job does (its filter on Beam's GCP-client warning)
SCRIPT = """
import logging, sys
from pipelines.plumbing import beam_worker
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

def warn(x):
    logging.getLogger("tokenbridge.test").warning("a warning that matters: %s", x)
    return x

args = ["--runner", "FnApiRunner", "--direct_num_workers", "2",
        "--direct_running_mode", "multi_processing"]
logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
logging.getLogger("apache_beam").setLevel(logging.WARNING)
runner = beam_worker.runner_for(args)
assert isinstance(runner, beam_worker.QuietFnApiRunner)
assert beam_worker.runner_for(["--runner", "DirectRunner"]) is None
with beam.Pipeline(runner=runner, options=PipelineOptions(args)) as p:
    p | beam.Create([7]) | beam.Map(warn)
print("done")
"""

NOISE = (
    "apitools",
    "Logging handler created",
    "Control channel established",
    "semi_persistent_directory",
    "sdk harness starting",
)


def test_workers_start_quietly_and_their_warnings_still_print():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=paths.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-3000:]
    assert proc.stderr.count("a warning that matters: 7") == 1, proc.stderr[-3000:]
    for noise in NOISE:
        assert noise not in proc.stderr, (noise, proc.stderr[-3000:])
