"""Where and when a benchmark section was measured, stated in the section itself, and whether the
code it measured has changed since.

A section opens with its commit, time, machine and load average, in bold when other work slowed
it. A section this machine cannot measure (CUDA) is kept with a note once its code has changed;
a move, or an edit of docstrings or comments alone, is no change (docs/bench.md).
"""

from __future__ import annotations

import ast
import datetime
import os
import platform
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the code a section's figures depend on, unless its module names a narrower ``MEASURES``
# (`measured_paths`): a change there makes a kept section stale
CODE_PATHS = ("tokenbridge", "trainer", "pipelines", "bench")
LIBRARY_PATHS = CODE_PATHS[:-1]
MARK = "_Measured on commit "
RESULTS = REPO / "bench" / "results"  # each section's stored file (`run_all`)


def _git(*args: str) -> str:
    r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def commit() -> str:
    """The short commit, ``+dirty`` when tracked files differ from it, or "unknown" (no git)."""
    head = _git("rev-parse", "--short=10", "HEAD")
    if not head:
        return "unknown"
    # the bench's own outputs do not count: a second section must not call the first's dirty
    outputs = (":(exclude)bench/results", ":(exclude)BENCHMARKS.md")
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", *outputs],
                           cwd=REPO).returncode != 0  # fmt: skip
    return head + ("+dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> float:
    return os.getloadavg()[0]


@dataclass
class Provenance:
    """Started when a section starts (`start`), finished when it ends (`line`)."""

    commit: str
    started: str
    device: str
    cores: int
    load_start: float
    load_end: float | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, *, device: str | None = None) -> Provenance:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        return cls(commit(), now, device or cpu_model(), os.cpu_count() or 1, load())

    @property
    def under_load(self) -> bool:
        return loaded(self.load_start, self.load_end or 0.0, self.cores)

    def line(self) -> str:
        """The section's provenance line (the end load is read now, once)."""
        if self.load_end is None:
            self.load_end = load()
        text = (
            f"{MARK}{self.commit}, {self.started}, {self.device}, {self.cores} cores; load "
            f"average {self.load_start:.1f} at the start, {self.load_end:.1f} at the end._"
        )
        return text + (UNDER_LOAD if self.under_load else "")


UNDER_LOAD = (
    " **Measured under load** (other work at its start, or twice the core count at its end): "
    "times are slowed."
)
_LOADS = re.compile(r"(\d+) cores; load average ([\d.]+) at the start, ([\d.]+) at the end\._")


def loaded(start: float, end: float, cores: int) -> bool:
    """Was a section slowed by other work? The load at its start is other work; at its end the
    1-minute average also counts the section's own processes (a 2-thread run and its teacher
    worker reach 2-3 on 2 cores), so only twice the cores there says someone else ran."""
    return start > cores or end > 2 * cores


def reflag(text: str) -> str:
    """A stored section's under-load mark re-derived from the loads its line states (`loaded`):
    the rule is applied the same way to sections measured before it changed."""
    found = _LOADS.search(text)
    if not found:
        return text
    cores, start, end = int(found[1]), float(found[2]), float(found[3])
    head, tail = text[: found.end()], text[found.end() :]
    tail = re.sub(r"^ \*\*Measured under load\*\*[^\n]*", "", tail)
    return head + (UNDER_LOAD if loaded(start, end, cores) else "") + tail


def recorded_line(path: Path, *, device: str) -> str:
    """A provenance line for a kept result that predates provenance lines, from git history:
    the commit that recorded the file (its figures were measured on that commit's working
    tree), that commit's date, and the device the section names."""
    found = _git("log", "-1", "--format=%h %cs", "--", str(path))
    sha, date = found.split() if found else ("unknown", "unknown date")
    return (
        f"{MARK}{sha}, {date} (read from git: the commit that recorded these figures), "
        f"{device}; load average not recorded._"
    )


def section_commit(text: str) -> str | None:
    """The commit a section's provenance line names, or None (a section without one)."""
    at = text.find(MARK)
    if at < 0:
        return None
    return text[at + len(MARK) :].split(",", 1)[0].split("+", 1)[0].strip() or None


def measured_paths(module: Path) -> tuple[str, ...]:
    """The paths a section's figures depend on: its module's top-level ``MEASURES`` tuple of
    repo paths (read without importing the module), else the library and the bench modules it
    imports."""
    if not module.is_file():
        return CODE_PATHS
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MEASURES" for t in node.targets
        ):
            paths = ast.literal_eval(node.value)
            missing = [q for q in paths if not (REPO / q).exists()]
            if missing:  # a renamed file would silently stop marking the section stale
                raise ValueError(f"{module.name}: MEASURES names missing paths {missing}")
            return tuple(paths)
    # the package code, and of bench/ only the modules this section imports (transitively):
    # a change to another section's script does not make this one stale
    return (*LIBRARY_PATHS, *sorted(_bench_imports(module)))


def _bench_imports(module: Path, seen: set[str] | None = None) -> set[str]:
    """The bench/ files `module` uses, itself included, following their own: what it imports,
    and the bench modules or scripts it names to launch (``run_child("bench.align.chat")``,
    ``-m bench.science.trl_gold_train``, ``"bench/onpolicy/fsdp_gather.py"``)."""
    seen = set() if seen is None else seen
    rel = module.relative_to(REPO).as_posix()
    if rel in seen or not module.is_file() or rel == "bench/provenance.py":
        return seen  # this module formats the lines; it measures nothing
    seen.add(rel)
    for node in ast.walk(ast.parse(module.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        for name in names:
            if name.startswith("bench/") and name.endswith(".py"):
                _bench_imports(REPO / name, seen)
            elif name.startswith("bench."):  # a module file; a package's __init__ measures nothing
                _bench_imports(REPO / (name.replace(".", "/") + ".py"), seen)
    return seen


def _renames(sha: str) -> dict[str, str]:
    """Files moved since `sha`: new path -> its path at `sha`. Found over the whole tree, so a
    move between folders is one rename, not a delete and an add."""
    out = {}
    for line in _git("diff", "--name-status", "-M", sha, "HEAD").splitlines():
        status, *names = line.split("\t")
        if status.startswith("R") and len(names) == 2:
            out[names[1]] = names[0]
    return out


def _under(path: str, paths: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths)


def _code(source: bytes) -> str | None:
    """A Python file's code without its docstrings (comments and layout never reach the AST),
    as a comparable string; None if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0].value if node.body and isinstance(node.body[0], ast.Expr) else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            node.body = node.body[1:]  # the docstring
    return ast.dump(tree)


_CODE: dict[str, str | None] = {}  # blob id -> `_code` of it, read once per process


def _same_code(pairs: list[tuple[str, str]]) -> list[bool]:
    """For each (old blob, new blob) of a Python file: is the code the same, docstrings and
    comments aside? The blobs not yet read come from one ``git cat-file --batch``."""
    todo = sorted({b for pair in pairs for b in pair} - _CODE.keys())
    if todo:
        r = subprocess.run(["git", "cat-file", "--batch"], cwd=REPO, capture_output=True,
                           input="".join(f"{b}\n" for b in todo).encode())  # fmt: skip
        out, at = r.stdout, 0
        for blob in todo:
            end = out.index(b"\n", at)
            head = out[at:end].split()  # "<id> blob <size>", or "<id> missing"
            size = int(head[2]) if len(head) == 3 else 0
            _CODE[blob] = _code(out[end + 1 : end + 1 + size]) if len(head) == 3 else None
            at = end + 1 + size + (1 if len(head) == 3 else 0)
    return [_CODE[a] is not None and _CODE[a] == _CODE[b] for a, b in pairs]


def _changed(sha: str, paths: tuple[str, ...]) -> list[str]:
    """The files under `paths` whose code differs between `sha` and HEAD: a file moved
    unchanged, or whose docstrings or comments alone changed (Python files), is not listed."""
    entries = []  # (old blob, new blob, path now)
    for line in _git("diff", "--raw", "--no-abbrev", "-M", sha, "HEAD", "--", *paths).splitlines():
        meta, *names = line.split("\t")
        _, _, old, new, _ = meta.split()
        entries.append((old, new, names[-1]))
    py = [(o, n) for o, n, f in entries  # both sides present (an all-zero id: added, deleted)
          if f.endswith(".py") and o != n and o.strip("0") and n.strip("0")]  # fmt: skip
    same = dict(zip(py, _same_code(py)))
    return [f for o, n, f in entries if o != n and not same.get((o, n), False)]


def stale_note(text: str, paths: tuple[str, ...] = CODE_PATHS) -> str | None:
    """Under a kept section: whether the code it measures (`paths`) changed since the commit
    it names. A file moved since (bench/'s folders) is followed to its path at that commit; a
    move alone, or an edit of docstrings or comments alone, changes no figure."""
    sha = section_commit(text)
    if sha is None and "Not run" in text:
        return None  # no figures to be stale
    if sha is None:
        return "_This section names no commit: it predates provenance lines; treat as stale._"
    if not _git("rev-parse", "--verify", "--quiet", f"{sha}^{{commit}}"):
        return f"_Commit {sha} is not in this checkout: whether the code changed is unknown._"
    if not _git("log", "--oneline", f"{sha}..HEAD", "--", *paths):
        return None
    moved = {new: old for new, old in _renames(sha).items() if _under(new, paths)}
    then = (*paths, *moved.values())  # the same files, as named at `sha`
    if not _changed(sha, then):
        return None  # commits were undone, or moved files or edited their prose: the same code
    n = len(_git("log", "--oneline", f"{sha}..HEAD", "--", *then).splitlines())
    what = "1 commit touches" if n == 1 else f"{n} commits touch"
    return f"_The code has changed since {sha} ({what} {', '.join(paths)})._"
