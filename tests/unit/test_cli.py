"""How commands fail (`tokenbridge.cli`, `trainer.launch`) and what is not printed at all.

In process, on the helper: one line of the documented form and the exit code for each kind of
failure, the traceback only with TOKENBRIDGE_DEBUG=1 (always for a bug), the rank rules of a
multi-process run, the note left for the launcher and the launcher's reading of it; Beam's
apitools warning dropped while other warnings print. The commands themselves, as a user runs
them, are in tests/e2e/test_errors.py.
"""

from __future__ import annotations

import json
import logging
import signal
import types
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO
from tokenbridge import cli
from tokenbridge.formats.shards import FingerprintMismatchError
from trainer import launch
from trainer.main import RULES, hydra_overrides


class FakeWorkerError(RuntimeError):
    pass


def fails(exc: BaseException):
    def main(argv):
        raise exc

    return main


def run(exc: BaseException, capsys, **kw) -> tuple[int, list[str], str]:
    code = cli.run(fails(exc), [], prog="tool", **kw)
    err = capsys.readouterr().err
    return code, err.splitlines(), err


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.delenv(cli.LAUNCHER_ENV, raising=False)
    monkeypatch.setattr(cli, "PEER_WAIT_S", 0.0)


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (FileNotFoundError("data.shards=/x: no such shard directory"), 2,
         "tokenbridge tool: FileNotFoundError: data.shards=/x: no such shard directory"),
        (FingerprintMismatchError("/s: teacher 0 tokenizer differs\nmore"), 2,
         "tokenbridge tool: FingerprintMismatchError: /s: teacher 0 tokenizer differs"),
        (cli.UsageError("unknown option '--lr'"), 2,
         "tokenbridge tool: UsageError: unknown option '--lr'"),
        (FileExistsError("out: complete; --overwrite replaces it"), 2,
         "tokenbridge tool: FileExistsError: out: complete; --overwrite replaces it"),
        (MemoryError(), 1, "tokenbridge tool: MemoryError; out of memory: use smaller batches"),
        (KeyboardInterrupt(), 130, "tokenbridge tool: interrupted"),
    ],
)  # fmt: skip
def test_each_known_failure_is_one_line_and_its_exit_code(capsys, exc, code, line):
    got, lines, err = run(exc, capsys)
    assert got == code and len(lines) == 1 and lines[0].startswith(line), err
    assert "Traceback" not in err
    assert (f"{cli.DEBUG_ENV}=1 shows the traceback" in err) == (code == cli.EXIT_RUN)


def test_unfinished_directories_and_downloads_are_known_failures(capsys):
    """Named in cli.BASE_RULES (RuntimeErrors, else they would read as bugs), for every command
    that meets them: the trainer, the teacher-cache job, `make models`, `trainer.eval.datasets`."""
    from tokenbridge.assets.store import ChecksumError
    from tokenbridge.formats.shards import IncompleteShardsError
    from tokenbridge.formats.teacher_cache_reader import IncompleteCacheError

    cases = [
        (IncompleteShardsError("/s: no COMPLETED marker; rerun the align job"), 2),
        (IncompleteCacheError("/c: no COMPLETED marker"), 2),
        (ChecksumError("w.whl", expected="ab", found="cd"), 1),
    ]
    for exc, code in cases:
        got, lines, err = run(exc, capsys)
        assert got == code and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"tokenbridge tool: {type(exc).__name__}: {exc}")


def _entry_points() -> list[Path]:
    """Every module a user runs: a ``__main__.py`` or one with a ``__main__`` block."""
    found = []
    for pkg in ("tokenbridge", "pipelines", "trainer"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if path.name == "__main__.py" or 'if __name__ == "__main__":' in text:
                found.append(path)
    return found


def test_every_command_ends_through_cli_run():
    """A command added later gets the one-line errors too: its module runs its ``main`` through
    cli.run. trainer.launch is torchrun's wrapper: it reads the ranks' lines instead (tested
    below); pipelines.plumbing.beam_worker is Beam's worker process, started by the runner, not a user."""
    points = _entry_points()
    assert len(points) >= 12
    missing = []
    for path in points:
        rel = path.relative_to(REPO).as_posix()
        if rel in ("trainer/launch.py", "pipelines/plumbing/beam_worker.py"):
            continue
        if "cli.run(" not in path.read_text(encoding="utf-8"):
            missing.append(rel)
    assert not missing, f"commands that do not end through tokenbridge.cli.run: {missing}"


def test_debug_switch_adds_the_traceback_and_keeps_code_and_line(capsys, monkeypatch):
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    code, lines, err = run(FileNotFoundError("x: missing"), capsys)
    assert code == 2 and err.startswith("Traceback") and "raise exc" in err
    assert lines[-1] == "tokenbridge tool: FileNotFoundError: x: missing"


def test_a_bug_keeps_its_traceback_and_says_so(capsys):
    code, lines, err = run(TypeError("unsupported operand"), capsys)
    assert code == 1 and err.startswith("Traceback")
    assert lines[-1].startswith("tokenbridge tool: TypeError: unsupported operand (an internal")


def test_rules_by_name_hints_and_first_line_only(capsys):
    rules = (cli.Rule((f"{__name__}.FakeWorkerError",), hint=lambda e: "check dmesg"),)
    code, lines, err = run(FakeWorkerError("worker died: KeyError: 3\nits traceback:\n  ..."),
                           capsys, rules=rules)  # fmt: skip
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("tokenbridge tool: FakeWorkerError: worker died: KeyError: 3; check")
    assert not cli.Rule((f"{__name__}.Other",)).matches(FakeWorkerError())
    with pytest.raises(SystemExit):
        cli.run(fails(SystemExit(2)), [], prog="tool")


def test_ranks_say_it_once(capsys, monkeypatch):
    everywhere = cli.same_on_every_rank(ValueError("config x: bad"))
    code, lines, _ = run(everywhere, capsys, rank=0, world_size=2)
    assert code == 2 and lines == ["tokenbridge tool: ValueError: config x: bad"]
    # plain torchrun: rank 1 waits for rank 0 to say it; still alive after the wait, it says it
    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    code, lines, _ = run(cli.same_on_every_rank(ValueError("bad")), capsys, rank=1, world_size=2)
    assert code == 2 and slept == [cli.PEER_WAIT_S]
    assert lines == ["tokenbridge tool [rank 1/2]: ValueError: bad"]
    # a failure of its own: the rank says it at once; a peer's lost link: nothing at all
    code, lines, _ = run(OSError("disk full"), capsys, rank=1, world_size=2)
    assert code == 1 and lines[0].startswith("tokenbridge tool [rank 1/2]: OSError: disk full")
    lost = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:22933")
    assert run(lost, capsys, rules=RULES, rank=1, world_size=2)[:2] == (1, [])


def test_trainer_rules_name_worker_timeout_and_nonfinite_errors(capsys):
    from trainer.run_log import NonFiniteError
    from trainer.teacher.ring import TeacherTimeoutError, TeacherWorkerError

    killed = TeacherWorkerError("teacher worker (pid 7) was killed by signal SIGKILL while x")
    _, lines, _ = run(killed, capsys, rules=RULES)
    assert lines[0].startswith("tokenbridge tool: TeacherWorkerError: teacher worker (pid 7)")
    assert "out-of-memory killer" in lines[0]
    _, lines, _ = run(TeacherTimeoutError("no answer in 1.0 s"), capsys, rules=RULES)
    assert "parallel.teacher_timeout_s" in lines[0]
    code, lines, _ = run(NonFiniteError("step 3: non-finite CE"), capsys, rules=RULES, world_size=2)
    assert code == 1 and lines[0].startswith("tokenbridge tool: NonFiniteError: step 3")
    with pytest.raises(cli.UsageError, match="unknown option"):
        hydra_overrides(["--lr", "1"])


def test_launcher_notes_and_its_reading(capsys, monkeypatch, tmp_path):
    """What ranks leave in torchrun's error files under trainer.launch, and what the launcher
    makes of them: nothing when a rank printed its line, else the line that explains most."""
    monkeypatch.setenv(cli.LAUNCHER_ENV, "1")
    cases = {
        "printed": (0, FileNotFoundError("x: missing")),
        "quiet": (1, RuntimeError("Connection closed by peer")),
        "held": (1, cli.same_on_every_rank(ValueError("config x: bad"))),
    }
    notes, said = {}, {}
    for kind, (rank, exc) in cases.items():
        path = tmp_path / f"{kind}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        said[kind] = run(exc, capsys, rules=RULES, rank=rank, world_size=2)[1]
        notes[kind] = json.loads(path.read_text())["message"]
        assert notes[kind]["tokenbridge"]["kind"] == kind and int(
            notes[kind]["extraInfo"]["timestamp"]
        )
    assert said["quiet"] == said["held"] == []  # held: said by rank 0, else by the launcher
    assert notes["held"]["tokenbridge"]["line"] == "tokenbridge tool: ValueError: config x: bad"

    def failure(rank, code, note=None, t=5):
        data = {"message": notes[note]} if note else {}
        return types.SimpleNamespace(
            exitcode=code, pid=100 + rank, timestamp=t, error_file_data=data
        )

    term = -signal.SIGTERM  # a rank torchrun stopped
    assert launch.explain({0: failure(0, 2, "printed"), 1: failure(1, 1, "quiet")}) == (None, 2)
    # stopped by torchrun just after it reported: its code is the one it meant
    assert launch.explain({0: failure(0, term, "printed"), 1: failure(1, 2, "held")}) == (None, 2)
    # rank 0 stopped before it could say an error every rank met: the launcher says it, code 2
    held = launch.explain({0: failure(0, term), 1: failure(1, 2, "held")})
    assert held == ("tokenbridge tool: ValueError: config x: bad", 2)
    # rank 0 killed by the OOM killer, rank 1 lost its link: rank 0's end is the news
    line, code = launch.explain({0: failure(0, -signal.SIGKILL, t=6), 1: failure(1, 1, "quiet")})
    assert line.startswith("tokenbridge train [rank 0]: the process (pid 100) was killed by")
    assert "out-of-memory" in line and code == 1
    lost = launch.explain({0: failure(0, term), 1: failure(1, 1, "quiet")})
    assert lost == (notes["quiet"]["tokenbridge"]["line"], 1)


def test_beam_apitools_warning_is_dropped_other_warnings_print(caplog):
    import pipelines  # noqa: F401  (installs the filter)

    with caplog.at_level(logging.WARNING):
        logging.warning(
            "apitools not found, and bigquery client libraries are not available despite the "
            "import not raising an ImportError."
        )
        logging.warning("a warning that matters")
        logging.getLogger("apache_beam.io").warning("beam says something")
    assert [r.getMessage() for r in caplog.records] == [
        "a warning that matters",
        "beam says something",
    ]


def test_hydra_errors_fold_into_the_one_line(capsys):
    from trainer.main import main

    assert main(["conf=nope"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "tokenbridge train: ConfigError: config: In 'train': Could not find 'experiment/nope'; "
        "Available options in 'experiment': "
    )
    assert {"debug", "demo"} <= set(lines[0].rsplit(": ", 1)[1].split(", "))
