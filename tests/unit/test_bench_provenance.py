"""Every BENCHMARKS section states where it ran (`bench.provenance`), and `bench.run_all`
writes the file from the stored sections only, refusing a loaded machine unless told."""

from __future__ import annotations

import pytest

from bench import provenance, run_all


def test_a_section_line_names_its_commit_machine_and_load():
    p = provenance.Provenance("abc1234567", "2026-11-26 21:00 UTC", "Some CPU", 2, 0.5)
    p.load_end = 1.5
    line = p.line()
    assert "abc1234567" in line and "Some CPU, 2 cores" in line and "0.5" in line
    assert "under load" not in line
    assert provenance.section_commit(f"## x\n\n{line}\nbody") == "abc1234567"
    p.load_end = 4.5  # twice the cores at its end: more than its own processes
    assert "**Measured under load**" in p.line()


def test_the_commit_is_this_checkout_s():
    sha = provenance.commit()
    assert sha == "unknown" or len(sha.split("+")[0]) == 10


def test_a_kept_section_says_when_the_code_changed_since():
    assert "predates provenance" in provenance.stale_note("## old\n\nno line here\n")
    head = provenance.commit().split("+")[0]
    assert provenance.stale_note(f"## s\n\n{provenance.MARK}{head}, now_") is None
    # an older commit that touched the code (a shallow clone may hold none)
    older = provenance._git("log", "--format=%h", "-n", "1", "--skip=1", "HEAD", "--", "bench")
    if older and provenance._changed(older, provenance.CODE_PATHS):  # not docstrings alone
        note = provenance.stale_note(f"## s\n\n{provenance.MARK}{older}, then_")
        assert note is not None and "changed since" in note
    assert "not in this checkout" in provenance.stale_note(f"{provenance.MARK}0123456789, x_")


def test_a_section_is_stale_only_when_the_code_it_measures_changed():
    for name in run_all.discover():  # every MEASURES names paths that exist (else it raises)
        assert run_all.module_file(name).is_file(), name
        paths = provenance.measured_paths(run_all.module_file(name))
        assert paths and all((provenance.REPO / p).exists() for p in paths), (name, paths)
    # without MEASURES: the library, and of bench/ what the section imports or launches
    onpolicy = provenance.measured_paths(run_all.module_file("onpolicy"))
    assert {"trainer", "bench/onpolicy/vs_trl.py", "bench/onpolicy/fsdp_gather.py"} <= set(onpolicy)
    assert "bench/training/losses.py" not in onpolicy and "bench" not in onpolicy
    science = provenance.measured_paths(run_all.module_file("science"))
    assert "bench/science/trl_gold_train.py" in science  # launched with ``-m``, not imported
    # the last commit that touched the losses section: stale for the whole tree once a later
    # commit touched bench/, not for the file itself
    sha = provenance._git("log", "-1", "--format=%h", "--", "bench/training/losses.py")
    later = provenance._git("log", "--oneline", f"{sha}..HEAD", "--", "bench") if sha else ""
    if later and provenance._changed(sha, provenance.CODE_PATHS):  # code, not docstrings alone
        text = f"## s\n\n{provenance.MARK}{sha}, then_"
        assert provenance.stale_note(text, ("bench/training/losses.py",)) is None
        assert "changed since" in provenance.stale_note(text)


def test_a_loaded_machine_is_refused_unless_allowed(monkeypatch, tmp_path):
    monkeypatch.setattr(provenance, "load", lambda: 99.0)
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    with pytest.raises(SystemExit, match="--allow-load"):
        run_all.run_one("provenance_probe", allow_load=False)


def test_collect_marks_sections_never_run(monkeypatch, tmp_path):
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    monkeypatch.setattr(run_all, "SECTIONS", {"alpha": "alpha", "beta": "beta"})
    head = provenance.commit().split("+")[0]
    (tmp_path / "alpha.md").write_text(f"## Alpha\n\n{provenance.MARK}{head}, t_\n| 1 |\n")
    text = run_all.collect()
    assert "## Alpha" in text and "| 1 |" in text
    assert "## beta\n\nNot run yet" in text


def test_a_kept_section_gains_the_provenance_line_its_module_derives(tmp_path):
    stored = tmp_path / "gpu.md"
    stored.write_text("## GPU\n\nfigures\n\n_(section ran in 9 s)_\n")
    line = f"{provenance.MARK}abcdef1234, 2026-11-27 02:59 UTC, H200; load average not recorded._"
    run_all._add_provenance(stored, f"## GPU\n\n{line}\n\nfigures\n\n{run_all.KEPT} x)_")
    assert stored.read_text() == f"## GPU\n\n{line}\n\nfigures\n\n_(section ran in 9 s)_\n"
    run_all._add_provenance(stored, f"## GPU\n\n{provenance.MARK}0000000000, y_\n")
    assert provenance.section_commit(stored.read_text()) == "abcdef1234"  # kept as it was


def test_the_under_load_mark_follows_the_loads_a_line_states():
    def line(start, end):
        p = provenance.Provenance("abc1234567", "t", "Some CPU", 2, start)
        p.load_end = end
        return f"## s\n\n{p.line()}\nbody\n"

    assert "under load" not in line(0.0, 2.9)  # its own processes at the end
    assert "under load" in line(2.5, 1.0) and "under load" in line(0.5, 4.5)
    stale = line(0.0, 2.9).replace("end._", "end._ **Measured under load** (old rule).")
    assert provenance.reflag(stale) == line(0.0, 2.9)
    assert provenance.reflag(line(2.5, 1.0)) == line(2.5, 1.0)


def test_run_all_help_and_unknown_names_run_nothing(monkeypatch, capsys):
    """``--help`` prints the usage and ``NAME`` must be a section: neither runs a benchmark
    (a ``--help`` once started every section)."""
    ran = []
    monkeypatch.setattr(run_all, "run_one", lambda name, **kw: ran.append(name))
    for argv, code in ((["--help"], 0), (["nosuch"], 2), (["--no-such-flag"], 2)):
        with pytest.raises(SystemExit) as e:
            run_all.main(argv)
        assert e.value.code == code
    assert ran == [] and "unknown sections ['nosuch']" in capsys.readouterr().err


def test_commits_undone_leave_a_section_fresh(monkeypatch, tmp_path):
    """A change and its revert after a section's commit: the code it measured is the same, so
    it is not called stale; a change that stays is."""
    import subprocess

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                           cwd=tmp_path, capture_output=True, text=True, check=True)  # fmt: skip
        return r.stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("add", "-A")
    git("commit", "-qm", "measured")
    sha = git("rev-parse", "--short=10", "HEAD")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    text = f"## s\n\n{provenance.MARK}{sha}, then_"
    for body, stale in (("a = 2\n", True), ("a = 1\n", False)):  # changed, then undone
        (tmp_path / "code.py").write_text(body)
        git("commit", "-qam", "edit")
        note = provenance.stale_note(text, ("code.py",))
        assert (note is not None) == stale, (body, note)
    assert note is None  # two commits touched code.py since, and it is back as measured


def test_a_file_moved_unchanged_leaves_a_section_fresh(monkeypatch, tmp_path):
    """A section measured before its code moved (bench/'s folders): the move alone is no change,
    so it names the new path and is not stale; a change to the moved file is."""
    import subprocess

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                           cwd=tmp_path, capture_output=True, text=True, check=True)  # fmt: skip
        return r.stdout.strip()

    git("init", "-q")
    (tmp_path / "old.py").write_text("".join(f"line_{i} = {i}\n" for i in range(20)))
    git("add", "-A")
    git("commit", "-qm", "measured")
    sha = git("rev-parse", "--short=10", "HEAD")
    (tmp_path / "new").mkdir()
    git("mv", "old.py", "new/moved.py")
    git("commit", "-qm", "move")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    text = f"## s\n\n{provenance.MARK}{sha}, then_"
    assert provenance.stale_note(text, ("new/moved.py",)) is None
    assert provenance.stale_note(text, ("new",)) is None
    with (tmp_path / "new" / "moved.py").open("a") as f:
        f.write("line_20 = 20\n")
    git("commit", "-qam", "edit")
    note = provenance.stale_note(text, ("new/moved.py",))
    assert note is not None and "2 commits touch new/moved.py" in note


def test_docstrings_and_comments_alone_leave_a_section_fresh(monkeypatch, tmp_path):
    """Edits of a Python file's docstrings, comments or layout change no figure, even in a file
    moved since; a change to its code, or to a file that is not Python, makes the section stale."""
    import subprocess

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                           cwd=tmp_path, capture_output=True, text=True, check=True)  # fmt: skip
        return r.stdout.strip()

    code = 'def f(x):\n    """Twice x."""\n    return 2 * x  # doubled\n'
    rest = "".join(f"line_{i} = {i}\n" for i in range(20))  # enough for git to see b.py moved
    (tmp_path / "a.py").write_text('"""A module."""\n\n' + code)
    (tmp_path / "b.py").write_text(code + rest)
    (tmp_path / "conf.yaml").write_text("k: 1\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "measured")
    sha = git("rev-parse", "--short=10", "HEAD")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    text = f"## s\n\n{provenance.MARK}{sha}, then_"
    prose = 'def f(x):\n    """Double."""\n\n    # why: a comment\n    return 2 * x\n'
    (tmp_path / "a.py").write_text('"""The module, said again\nat length."""\n' + prose)
    (tmp_path / "sub").mkdir()
    git("mv", "b.py", "sub/b.py")
    (tmp_path / "sub" / "b.py").write_text(prose + rest)
    git("add", "-A")
    git("commit", "-qm", "prose")
    assert provenance.stale_note(text, ("a.py", "sub")) is None
    assert provenance.stale_note(text) is None  # the default paths name none of these files
    for path, body in (("a.py", prose.replace("2 * x", "x + x")), ("conf.yaml", "k: 2\n")):
        before = (tmp_path / path).read_text()
        (tmp_path / path).write_text(body)
        git("commit", "-qam", f"edit {path}")
        note = provenance.stale_note(text, (path,))
        assert note is not None and "changed since" in note, path
        (tmp_path / path).write_text(before)
        git("commit", "-qam", f"undo {path}")
    assert provenance.stale_note(text, ("a.py", "sub", "conf.yaml")) is None
