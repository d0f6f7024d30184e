"""The import graph of the three floors, `bench/` and `tests/`: no cycles, and the layering
docs/design.md states.

Read with `ast`, nothing is imported: every ``import`` and ``from ... import`` statement counts,
at module level or inside a function (a lazy import only hides a cycle until the function runs),
relative imports are resolved against the importing module's package, and ``from pkg import y``
points at the submodule ``pkg.y`` when there is one, else at ``pkg`` itself (the names come
from its ``__init__``). Two choices, and why:

- imports under ``if TYPE_CHECKING:`` are left out of the cycle check: they never execute, so
  they cannot form a runtime cycle (the layering checks still see them);
- importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``: an edge is drawn to each
  of those parents that is not a parent of the importing module itself. A module inside ``a``
  runs after ``a/__init__`` has started whatever the order, so such an edge would call every
  package whose ``__init__`` re-exports its modules a cycle; from outside the package it is a
  real edge (``x`` -> ``a.b.c`` runs ``a/__init__``, whose imports may lead back to ``x``, still
  half-initialised: an ImportError that depends on which module a process imports first).

Layering (docs/design.md), with no exception: `tokenbridge/` (the library) imports none of the
others; `pipelines/` (Beam) and `trainer/` (torchrun) import the library and never each other;
nothing in the product imports `bench/`; nothing but `tests/` imports `tests/` (the tests may
import every floor and `bench/`, whose shared inputs they use); `apache_beam` is imported under
`pipelines/` only, Hydra and omegaconf under `trainer/` (and `bench/`, which drives it) only,
the tests aside. Module file names are unique across the floors and `bench/` (`__init__` and
`__main__` aside, `job`: each job folder's pipeline assembly, and `section`: each bench folder's
BENCHMARKS.md section), so a name in a traceback or a doc points at one file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tokenbridge import paths

ROOTS = ("tokenbridge", "pipelines", "trainer", "bench", "tests")
# floor -> the floors it may import (itself included)
MAY_IMPORT = {
    "tokenbridge": {"tokenbridge"},
    "pipelines": {"tokenbridge", "pipelines"},
    "trainer": {"tokenbridge", "trainer"},
    "bench": {"tokenbridge", "pipelines", "trainer", "bench"},
    "tests": {"tokenbridge", "pipelines", "trainer", "bench", "tests"},
}
# external package -> the floors that may import it
ONLY_IN = {
    "apache_beam": {"pipelines", "tests"},
    "hydra": {"trainer", "bench", "tests"},
    "omegaconf": {"trainer", "bench", "tests"},
}
SHARED_NAMES = {"__init__", "__main__", "job", "section"}
# the tests' file names follow pytest's rules (a conftest per folder), not the floors'
UNIQUE_NAMES_IN = ("tokenbridge", "pipelines", "trainer", "bench")


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    runtime: set[str] = field(default_factory=set)  # internal modules it imports when it runs
    typing_only: set[str] = field(default_factory=set)  # under `if TYPE_CHECKING:`
    external: set[str] = field(default_factory=set)  # top-level names of other packages


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """(node, typing_only) for every import statement anywhere in `tree`."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, typing_only
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += [(n, True) for n in node.body] + [(n, typing_only) for n in node.orelse]
            continue
        stack += [(n, typing_only) for n in ast.iter_child_nodes(node)]


def _resolve_from(mod: Module, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import ...`` reads from (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(mod: Module, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """Absolute names of what `node` imports: a submodule where one exists, else its package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = _resolve_from(mod, node)
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if sub in known else base)
    return out


def _imports_by_name(tree: ast.AST, known: set[str]) -> set[str]:
    """Internal modules named by string constants, where the module calls ``import_module``."""
    calls = any(
        isinstance(n, ast.Call)
        and getattr(n.func, "attr", getattr(n.func, "id", None)) in ("import_module", "__import__")
        for n in ast.walk(tree)
    )
    if not calls:
        return set()
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in known
    }


def _outside_parents(target: str, mod: Module) -> set[str]:
    """The packages that importing `target` runs first and that do not hold `mod` itself."""
    own = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    parts = target.split(".")
    out = set()
    for i in range(2, len(parts)):  # the floor's own __init__ (i = 1) holds nothing
        parent = ".".join(parts[:i])
        if parts[:i] != own[:i]:
            out.add(parent)
    return out


def build_graph(repo: Path = paths.REPO_ROOT) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            name, is_package = _module_name(path, repo)
            modules[name] = Module(name, path, is_package)
    known = set(modules)
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(encoding="utf-8"), filename=str(mod.path))
        for node, typing_only in _imports(tree):
            for target in _targets(mod, node, known):
                if target.split(".")[0] not in ROOTS:
                    mod.external.add(target.split(".")[0])
                    continue
                # `import trainer.x.y` where only `trainer.x` exists (a name, not a module)
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != mod.name:
                    edges = mod.typing_only if typing_only else mod.runtime
                    edges.add(target)
                    edges.update(_outside_parents(target, mod))
        mod.runtime |= _imports_by_name(tree, known) - {mod.name}
    return modules


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per circle of modules, each as the path ``[a, b, ..., a]`` (stable order)."""
    return sorted(_cycle_in(comp, edges) for comp in circles(edges))


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def _cycle_in(comp: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def reachable(edges: dict[str, set[str]], starts: set[str]) -> set[str]:
    seen, todo = set(starts), list(starts)
    while todo:
        for w in edges.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def floor_breaches(g: dict[str, Module]) -> dict[str, list[str]]:
    """module -> the modules of floors it may not import (any import, typing-only too)."""
    bad = {}
    for name, m in g.items():
        allowed = MAY_IMPORT[name.split(".")[0]]
        hits = sorted(t for t in m.runtime | m.typing_only if t.split(".")[0] not in allowed)
        if hits:
            bad[name] = hits
    return bad


def misplaced_externals(g: dict[str, Module]) -> list[str]:
    """'module: package' for every import of a package outside the floors allowed to."""
    return sorted(
        f"{n}: {ext}"
        for n, m in g.items()
        for ext in m.external
        if ext in ONLY_IN and n.split(".")[0] not in ONLY_IN[ext]
    )


def shared_file_names(g: dict[str, Module]) -> dict[str, list[str]]:
    """file name -> the modules that share it (packages and SHARED_NAMES aside)."""
    by_name: dict[str, list[str]] = {}
    for n, m in g.items():
        if n.split(".")[0] not in UNIQUE_NAMES_IN:
            continue
        if not m.is_package and m.path.stem not in SHARED_NAMES:
            by_name.setdefault(m.path.stem, []).append(n)
    return {k: sorted(v) for k, v in by_name.items() if len(v) > 1}


# --- the checker itself, on a made-up tree -----------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_the_checker_sees_lazy_relative_and_submodule_imports(tmp_path):
    repo = _write(
        tmp_path,
        {
            "pipelines/__init__.py": "",
            "pipelines/a.py": "def f():\n    from pipelines import b\n",
            "pipelines/b.py": "from .c import X\n",
            "pipelines/c.py": "from . import a\nX = 1\n",
            "pipelines/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipelines import e\n",
            "pipelines/e.py": "import pipelines.d\n",
            "trainer/__init__.py": "from trainer.sub import thing\n",
            "trainer/sub/__init__.py": "from .leaf import thing\n",
            "trainer/sub/leaf.py": "import trainer.sub.other\nthing = 1\n",
            "trainer/sub/other.py": "from .. import sub\n",
            "trainer/lazy.py": "import importlib\nNAMES = {'x': 'trainer.sub.leaf'}\n"
            "def get(n):\n    return importlib.import_module(NAMES[n])\n",
            "tokenbridge/__init__.py": "",
            "bench/__init__.py": "",
        },
    )
    g = build_graph(repo)
    assert g["pipelines.a"].runtime == {"pipelines.b"}
    assert g["pipelines.b"].runtime == {"pipelines.c"}
    assert g["pipelines.d"].typing_only == {"pipelines.e"} and not g["pipelines.d"].runtime
    assert g["trainer.sub.other"].runtime == {"trainer.sub"}
    assert g["trainer.lazy"].runtime == {"trainer.sub.leaf"}
    cycles = find_cycles({m.name: m.runtime for m in g.values()})
    # a -> b -> c -> a through a lazy import; sub -> leaf -> other -> sub (names from __init__);
    # d <-> e is a cycle only for the type checker
    assert cycles == [
        ["pipelines.a", "pipelines.b", "pipelines.c", "pipelines.a"],
        ["trainer.sub", "trainer.sub.leaf", "trainer.sub.other", "trainer.sub"],
    ]
    assert not floor_breaches(g) and not misplaced_externals(g)


def test_the_checker_sees_a_cycle_through_a_package_init(tmp_path):
    """`out` imports a submodule of `losses`: that runs `losses/__init__` first, which imports
    `alm`, whose chain leads back to the half-initialised `out`. Inside a package, importing a
    sibling (alm -> losses.ops.cp) draws no edge to the package's own `__init__`."""
    repo = _write(
        tmp_path,
        {
            "tokenbridge/__init__.py": "",
            "tokenbridge/teacher/__init__.py": "",
            "tokenbridge/teacher/out.py": "from tokenbridge.losses.ops import vocab\n",
            "tokenbridge/losses/__init__.py": "from tokenbridge.losses import alm\n",
            "tokenbridge/losses/alm.py": "from tokenbridge.losses.ops.cp import f\n",
            "tokenbridge/losses/ops/__init__.py": "",
            "tokenbridge/losses/ops/vocab.py": "",
            "tokenbridge/losses/ops/cp.py": "from tokenbridge.teacher.out import X\n",
        },
    )
    g = build_graph(repo)
    assert g["tokenbridge.losses.alm"].runtime == {
        "tokenbridge.losses.ops",
        "tokenbridge.losses.ops.cp",
    }
    assert find_cycles({m.name: m.runtime for m in g.values()}) == [
        [
            "tokenbridge.losses",
            "tokenbridge.losses.alm",
            "tokenbridge.losses.ops.cp",
            "tokenbridge.teacher.out",
            "tokenbridge.losses",
        ]
    ]


def test_the_checker_sees_layering_breaches(tmp_path):
    repo = _write(
        tmp_path,
        {
            "tokenbridge/__init__.py": "",
            "tokenbridge/lib.py": "def f():\n    from trainer import loop\n",
            "tokenbridge/conf.py": "from omegaconf import OmegaConf\n",
            "pipelines/__init__.py": "",
            "pipelines/job.py": "import apache_beam as beam\nfrom tokenbridge import lib\n",
            "pipelines/uses_trainer.py": "from trainer import loop\n",
            "trainer/__init__.py": "",
            "trainer/loop.py": "from pipelines import job\nimport bench.b\n",
            "trainer/cli/job.py": "",
            "trainer/cli/__init__.py": "",
            "trainer/cli/lib.py": "import apache_beam\n",
            "bench/__init__.py": "",
            "bench/b.py": "from trainer import loop\nfrom pipelines import job\n",
        },
    )
    g = build_graph(repo)
    assert floor_breaches(g) == {
        "pipelines.uses_trainer": ["trainer.loop"],
        "tokenbridge.lib": ["trainer.loop"],
        "trainer.loop": ["bench.b", "pipelines.job"],
    }
    assert misplaced_externals(g) == ["tokenbridge.conf: omegaconf", "trainer.cli.lib: apache_beam"]
    # job.py twice is a job folder's assembly; lib.py twice is two things under one name
    assert shared_file_names(g) == {"lib": ["tokenbridge.lib", "trainer.cli.lib"]}


# --- the real tree ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree() -> dict[str, Module]:
    """The repository's graph, parsed once for the four checks below (~4 s each)."""
    return build_graph()


def test_no_import_cycles(tree):
    edges = {m.name: m.runtime for m in tree.values()}
    lines = []
    for comp in sorted(circles(edges), key=min):
        cycle = _cycle_in(comp, edges)
        more = sorted(comp - set(cycle))
        lines.append("  " + " -> ".join(cycle) + (f"  (same circle: {more})" if more else ""))
    assert not lines, "import cycles (function-level imports included):\n" + "\n".join(lines)


def test_each_floor_imports_only_the_floors_below(tree):
    bad = floor_breaches(tree)
    assert not bad, f"imports across the floors (docs/design.md, Layout): {bad}"


def test_beam_and_hydra_stay_on_their_floors(tree):
    bad = misplaced_externals(tree)
    assert not bad, f"apache_beam only under pipelines/, Hydra only under trainer/: {bad}"


def test_module_file_names_are_unique(tree):
    shared = shared_file_names(tree)
    assert not shared, f"one file name, several modules: {shared}"
