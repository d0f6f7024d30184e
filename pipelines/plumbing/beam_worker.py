"""Beam's local worker processes, started without their start-up chatter.

Beam's FnApiRunner starts each local worker from a fixed command line (``python -m
apache_beam.runners.worker.sdk_worker_main``), which printed a dozen INFO lines and warnings
about features we do not use. `QuietFnApiRunner` swaps it for ``python -m
pipelines.plumbing.beam_worker``: the same worker (`main` calls Beam's), with the package's log
filter installed before Beam is imported, and stderr kept for what a worker says before its log
service reaches the runner.
"""

from __future__ import annotations

import logging
import shlex
import sys

# (`python -m pipelines.plumbing.beam_worker` has imported the package `pipelines`, its filter, by now)
from apache_beam.portability import python_urns
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.runners.worker import sdk_worker_main
from apache_beam.runners.worker.log_handler import FnApiLogRecordHandler

BEAM_WORKER_COMMAND = f"{sys.executable} -m apache_beam.runners.worker.sdk_worker_main"
WORKER_COMMAND = f"{shlex.quote(sys.executable)} -m pipelines.plumbing.beam_worker"
RELAY_LOGGER = "apache_beam.runners.portability.local_job_service"  # logs "Worker: <record>"
# said by every worker without a staging directory; concerns user-registered schema types only
_SEMI_PERSISTENT = "No semi_persistent_directory found"


class QuietFnApiRunner(FnApiRunner):
    """FnApiRunner whose local worker processes start with `main` below (see the module)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        relay = logging.getLogger(RELAY_LOGGER)
        if not any(isinstance(f, _DropRelayedNoise) for f in relay.filters):
            relay.addFilter(_DropRelayedNoise())

    def run_via_runner_api(self, pipeline_proto, options):
        for env in pipeline_proto.components.environments.values():
            if (
                env.urn == python_urns.SUBPROCESS_SDK
                and env.payload == BEAM_WORKER_COMMAND.encode()
            ):
                env.payload = WORKER_COMMAND.encode()
        return super().run_via_runner_api(pipeline_proto, options)


def runner_for(beam_args: list[str]) -> QuietFnApiRunner | None:
    """The runner object to give ``beam.Pipeline`` for these arguments: ours for the
    FnApiRunner, None (Beam's choice from the options) for any other."""
    from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

    name = PipelineOptions(beam_args).view_as(StandardOptions).runner
    return QuietFnApiRunner() if name in ("FnApiRunner", None) else None


class _DropRelayedNoise(logging.Filter):
    """In the job's process: the runner's copy of a worker's semi_persistent_directory warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _SEMI_PERSISTENT not in record.getMessage()


class _UntilRelayed(logging.Filter):
    """In a worker: stderr only while no handler ships records to the runner."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(_SEMI_PERSISTENT):
            return False
        return not any(isinstance(h, FnApiLogRecordHandler) for h in logging.getLogger().handlers)


def main(argv: list[str] | None = None) -> None:
    # Importing Beam (above) called logging.warning, which gave the root a stderr handler
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING)
    for h in root.handlers:
        h.addFilter(_UntilRelayed())
        h.setLevel(max(h.level, logging.WARNING))
    sdk_worker_main.main(sys.argv if argv is None else argv)


if __name__ == "__main__":
    main()
