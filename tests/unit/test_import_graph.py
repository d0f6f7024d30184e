"""The import graph of `pipelines/` and `trainer/`: no cycles, and the layering DESIGN.md states.

Read with `ast`, nothing is imported: every ``import`` and ``from ... import`` statement counts,
at module level or inside a function (a lazy import only hides a cycle until the function runs),
relative imports are resolved against the importing module's package, and ``from pkg import y``
points at the submodule ``pkg.y`` when there is one, else at ``pkg`` itself (the names come
from its ``__init__``). Two choices, and why:

- imports under ``if TYPE_CHECKING:`` are left out of the cycle check: they never execute, so
  they cannot form a runtime cycle (the layering checks still see them);
- importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but no edge is drawn to
  those parents unless names are taken from them: Python runs a parent first whatever the order,
  so such an edge would call every package whose ``__init__`` re-exports its modules a cycle.

Layering (DESIGN.md, "Layout"): `pipelines/` never imports `trainer`, with one exception named
in `PIPELINES_MAY_IMPORT`: the teacher cache's RunInference handler runs the trainer's teacher
compute (`trainer.teacher.program`: the model build, the teacher outputs, and the config and
context types they take), so a cached output is the live teacher's output by construction, not
by a copy of the code. Nothing `trainer/` reaches through its imports, `pipelines` modules
included, imports apache_beam (the handler imports it, so the trainer can never import the
handler: no cycle through it either).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from pipelines import paths

ROOTS = ("pipelines", "trainer")
# pipelines module -> the trainer modules it may import (by name: a new one must be added here)
PIPELINES_MAY_IMPORT: dict[str, set[str]] = {
    "pipelines.teacher_cache.handler": {
        "trainer.teacher.program",  # TeacherModelProgram, the worker's teacher compute
        "trainer.teacher.worker",  # TeacherContext, what the program's setup takes
        "trainer.config",  # TeacherConfig, how the program names its teacher
        "trainer.losses.teacher_outputs",  # TeacherOutputSpec, what it computes
        "trainer.models",  # the lm_head width from config.json (no weights)
    },
}


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
                    (mod.typing_only if typing_only else mod.runtime).add(target)
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


def pipelines_importing_trainer(g: dict[str, Module]) -> dict[str, list[str]]:
    """pipelines module -> the trainer modules it imports (any import, typing-only too)."""
    bad = {}
    for name, m in g.items():
        if name.split(".")[0] == "pipelines":
            allowed = PIPELINES_MAY_IMPORT.get(name, set())
            hits = sorted(
                t for t in m.runtime | m.typing_only if t.startswith("trainer") and t not in allowed
            )
            if hits:
                bad[name] = hits
    return bad


def beam_reached_from_trainer(g: dict[str, Module]) -> list[str]:
    """Modules that import apache_beam and that some trainer module reaches through imports."""
    edges = {m.name: m.runtime | m.typing_only for m in g.values()}
    trainer = {n for n in g if n.split(".")[0] == "trainer"}
    return sorted(n for n in reachable(edges, trainer) if "apache_beam" in g[n].external)


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
    assert not pipelines_importing_trainer(g) and not beam_reached_from_trainer(g)


def test_the_checker_sees_layering_breaches(tmp_path):
    repo = _write(
        tmp_path,
        {
            "pipelines/__init__.py": "",
            "pipelines/job.py": "import apache_beam as beam\n",
            "pipelines/pure.py": "def f():\n    from pipelines.job import run\n",
            "pipelines/uses_trainer.py": "from trainer import loop\n",
            "trainer/__init__.py": "",
            "trainer/loop.py": "from pipelines import pure\n",
        },
    )
    g = build_graph(repo)
    assert pipelines_importing_trainer(g) == {"pipelines.uses_trainer": ["trainer.loop"]}
    assert beam_reached_from_trainer(g) == ["pipelines.job"]


# --- the real tree ------------------------------------------------------------------------------


def test_no_import_cycles():
    edges = {m.name: m.runtime for m in build_graph().values()}
    lines = []
    for comp in sorted(circles(edges), key=min):
        cycle = _cycle_in(comp, edges)
        more = sorted(comp - set(cycle))
        lines.append("  " + " -> ".join(cycle) + (f"  (same circle: {more})" if more else ""))
    assert not lines, "import cycles (function-level imports included):\n" + "\n".join(lines)


def test_pipelines_never_import_the_trainer():
    bad = pipelines_importing_trainer(build_graph())
    assert not bad, f"pipelines modules importing trainer modules: {bad}"


def test_the_trainer_never_reaches_apache_beam():
    beam = beam_reached_from_trainer(build_graph())
    assert not beam, f"trainer/ reaches modules that import apache_beam: {beam}"
