"""tokenbridge's offline half: the Beam jobs (align, teacher cache) and the projection command.

Importing the package drops one log record, Beam's "apitools not found" warning about GCP
clients we do not use (logged on every ``import apache_beam``); every other warning still
prints. Every entry point, and each local Beam worker (`pipelines.plumbing.beam_worker`),
imports this package before Beam (docs/pipelines.md, "One pipeline on every runner").
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
    # an SDK worker of Beam's multi-process runner (its environment names the control service).
    # One started by Beam's own command line imported Beam before us, too late for the filter,
    # and Beam's warning gave the root a stderr handler (``basicConfig``): raised to WARNING, the
    # worker's INFO records go only to Beam's log service (the runner), as Beam intends
    if "CONTROL_API_SERVICE_DESCRIPTOR" in os.environ:
        for h in root.handlers:
            if type(h) is logging.StreamHandler and h.level < logging.WARNING:
                h.setLevel(logging.WARNING)


_install()
