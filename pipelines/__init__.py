"""tokenbridge's offline half: tokenizers, alignment, shards, projection, the Beam jobs.

Importing the package drops one log record nobody here can act on: Beam's ``apitools not
found, and bigquery client libraries are not available`` (a module-level ``logging.warning`` in
``apache_beam.io.gcp.internal.clients.bigquery``, emitted on every ``import apache_beam`` without
the GCP extras, which we do not use). The filter sits on the root logger, where that record is
logged, and matches that message only: every other warning, Beam's included, still prints. It is
installed here because every entry point imports this package before Beam.

That ``logging.warning`` call also configures the root logger as a side effect (it calls
``basicConfig`` when the root has no handler), which is why the jobs call
``logging.basicConfig(..., force=True)``. The jobs' local worker processes (multi-process runs)
start through `pipelines.plumbing.beam_worker`, which imports this package before Beam and keeps their
start-up quiet. A worker started by Beam's own command line (another environment the caller
chose) has printed its start-up by the time a DoFn imports this package; there the filter comes
too late, and the stderr handler that side effect installed is raised to WARNING, so the worker's
INFO chatter goes only to Beam's log service (the runner), as Beam intends.
"""

from __future__ import annotations

import logging
import os

_GCP_NOISE = "apitools not found, and bigquery client libraries are not available"


class _DropGcpClientWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and str(record.msg).startswith(_GCP_NOISE))


def _install() -> None:
    root = logging.getLogger()
    if not any(isinstance(f, _DropGcpClientWarning) for f in root.filters):
        root.addFilter(_DropGcpClientWarning())
    # an SDK worker of Beam's multi-process runner (its environment names the control service)
    if "CONTROL_API_SERVICE_DESCRIPTOR" in os.environ:
        for h in root.handlers:
            if type(h) is logging.StreamHandler and h.level < logging.WARNING:
                h.setLevel(logging.WARNING)


_install()
