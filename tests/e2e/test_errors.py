"""What a user sees when a command fails: one line, the exit code, and nothing else.

Every command as a user runs it (a subprocess), given a bad config key, a missing shard
directory or a missing file: exactly one line on stderr, of the form ``tokenbridge <command>:
<ErrorType>: <what, where>[; what to do]``, exit code 2, no traceback unless
``TOKENBRIDGE_DEBUG=1`` (then it is there, and the same line ends it). The trainer under
`trainer.launch` with two ranks says it once. The align job prints no Beam apitools warning,
shows its own log lines, and still prints the warnings that matter. The commands are mostly
import time: the Beam jobs' and the launcher's start together as real subprocesses (their
import-time warnings are part of what is checked); the trainer's own commands are forked from
the session's `zygote`, which imported the trainer once. The run-time failures (a killed teacher worker, mismatched
shards) are checked on the runs of tests/e2e/test_debug_run.py and tests/dist.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO
from tokenbridge import paths

PY = sys.executable
MISSING = "/nonexistent/tokenbridge-test"
KEY_LINE = "tokenbridge train: ConfigError: config optim.lrr: no such key (closest: optim.lr)"


def commands(tmp) -> dict[str, tuple[list[str], dict, int, str]]:
    """name -> (argv, extra env, exit code, how stderr's only line starts)."""
    t, s = str(paths.teacher_dir()), str(paths.student_dir())
    debug = {"TOKENBRIDGE_DEBUG": "1"}
    train = [PY, "trainer/main.py", "conf=debug"]
    launch = [PY, "-m", "trainer.launch", "--standalone", "--nproc_per_node=2", "trainer/main.py"]
    return {
        "train_key": ([*train, "optim.lrr=1"], {}, 2, KEY_LINE),
        "train_key_debug": ([*train, "optim.lrr=1"], debug, 2, "Traceback"),
        "train_shards": ([*train, f"data.shards={MISSING}"], {}, 2,
                         f"tokenbridge train: FileNotFoundError: data.shards={MISSING}: no such"),
        "train_2_ranks": ([*launch, "conf=debug", "optim.lrr=1"], {}, 2, KEY_LINE),
        "projection": ([PY, "-m", "pipelines.projection", "--teacher", MISSING, "--student", s],
                       {}, 2, f"tokenbridge projection: TokenizerNotFoundError: {MISSING}: no such"),
        "pair_report": ([PY, "-m", "tokenbridge.commands.pair_report", t, MISSING], {}, 2,
                        f"tokenbridge pair_report: TokenizerNotFoundError: {MISSING}: no such"),
        "eval": ([PY, "-m", "trainer.eval", "--model", MISSING, "--tasks", "copa"], {}, 2,
                 f"tokenbridge eval: FileNotFoundError: {MISSING} is not a HF model directory"),
        "report": ([PY, "-m", "trainer.report", MISSING], {}, 2,
                   f"tokenbridge report: FileNotFoundError: {MISSING}: not a run folder"),
        "align": ([PY, "-m", "pipelines.align", "--data", f"{MISSING}/*.txt", "--teacher", t,
                   "--student", s, "--out", str(tmp / "out")], {}, 2,
                  f"tokenbridge align: FileNotFoundError: --data '{MISSING}/*.txt' matches no"),
        "teacher_cache": ([PY, "-m", "pipelines.teacher_cache", "--shards", MISSING, "--teacher",
                           t], {}, 2, f"tokenbridge teacher_cache: FileNotFoundError: {MISSING}: no"),
        "align_help": ([PY, "-m", "pipelines.align", "--help"], {}, 0, ""),
    }  # fmt: skip


# what the zygote has imported already (tests.zygote.PRELOAD): these start from it
FORKED = ("train_key", "train_key_debug", "train_shards", "pair_report", "eval", "report")


@pytest.fixture(scope="module")
def results(tmp_path_factory, zygote) -> dict:
    tmp = tmp_path_factory.mktemp("errors")
    base = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    base.pop("TOKENBRIDGE_DEBUG", None)
    procs, out = {}, {}
    for name, (argv, env, _, _) in commands(tmp).items():
        if name not in FORKED:
            procs[name] = subprocess.Popen(argv, cwd=REPO, env={**base, **env}, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    for name in FORKED:  # while the subprocesses import
        argv, env, _, _ = commands(tmp)[name]
        done = zygote.run(argv[1:], env={"TOKENBRIDGE_DEBUG": "0", **env}, timeout=300)
        out[name] = (done.returncode, done.stdout, done.stderr)
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = (p.returncode, stdout, stderr)
    return {"results": out, "expected": commands(tmp)}


@pytest.mark.parametrize("name", [n for n in commands(REPO) if not n.endswith(("_debug", "help"))])
def test_a_failing_command_prints_one_line_and_its_exit_code(results, name):
    code, _, err = results["results"][name]
    _, _, want_code, start = results["expected"][name]
    lines = err.strip().splitlines()
    assert code == want_code and len(lines) == 1 and lines[0].startswith(start), err[-3000:]
    assert "Traceback" not in err


def test_the_debug_switch_shows_the_traceback_then_the_same_line(results):
    code, _, err = results["results"]["train_key_debug"]
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("Traceback") and lines[-1].startswith(KEY_LINE)


def test_align_job_help_has_no_beam_gcp_warning(results):
    code, out, err = results["results"]["align_help"]
    assert code == 0 and "--teacher" in out
    assert err == "", err  # Beam's "apitools not found..." came here before


def test_tiny_align_job_shows_its_own_log_and_no_gcp_warning(tmp_path):
    data = tmp_path / "doc.txt"
    text = sorted((paths.corpus_dir() / "shakespeare").glob("*.txt"))[0].read_text()
    data.write_text(text[5000:7000])
    argv = [PY, "-m", "pipelines.align", "--data", str(data), "--teacher",
            str(paths.teacher_dir()), "--student", str(paths.student_dir()),
            "--out", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "apitools" not in proc.stderr and "Traceback" not in proc.stderr
    assert "align: 1 files" in proc.stderr  # the job's own log.info (root logging was taken)
    assert "1 documents ->" in proc.stdout
