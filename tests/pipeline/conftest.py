"""Fixtures for the Beam job tests: the real pair, loaded once through the job's own cache; a
Dask cluster started from the command line; model directories uploaded to the test store."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.daskcluster import DaskCluster
from pipelines.align import align_dofns as F
from tokenbridge import urls


@pytest.fixture(scope="session")
def pair_paths(teacher_dir, student_dir) -> tuple[str, str]:
    """(teacher, student) path strings exactly as the job receives them, so DoFn.setup() in the
    in-process runner finds the tokenizers already in its per-process cache."""
    return str(teacher_dir), str(student_dir)


@pytest.fixture(scope="session")
def pair_tokenizers(pair_paths):
    t, s = pair_paths
    return F.cached_tokenizer(t), F.cached_tokenizer(s)


@pytest.fixture(scope="session")
def dask_cluster(s3_server, tmp_path_factory, at_unit_end):
    """One Dask cluster started from the command line (`bench.daskcluster`) for the session:
    the align and teacher-cache jobs both run on it (one unit: stopped after its last test).
    Its workers' environment points at the test S3 server; they share no cache with this
    process."""
    cluster = DaskCluster(tmp_path_factory.mktemp("dask"), env=s3_server.env()).start()
    at_unit_end("dask_cluster", cluster.stop)
    yield cluster
    cluster.stop()


def local_paths(argv: list[str]) -> list[str]:
    """The arguments of `argv` that name a path on this machine (a file, a glob, a directory)."""
    return [
        a
        for a in argv
        if not a.startswith("-") and not urls.is_url(a) and ("/" in a or Path(a).exists())
    ]
