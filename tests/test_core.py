"""The core reads in one sitting: model.py, stream.py, optim.py and train.py within their line budgets, every
line at most 100 columns; the import graph of the core and megatrain_min/ acyclic, model.py and optim.py
importing nothing of ours and stream.py only those two; no module reaching into another's underscored names;
no comment narrating history (issue numbers, commit hashes)."""
import ast
import re

import pytest

from conftest import ROOT

BUDGET = {"model.py": 380, "stream.py": 450, "optim.py": 160, "train.py": 300}   # physical lines
COLUMNS = 100
CORE = {name[:-3] for name in BUDGET}
LIBRARY = sorted((ROOT / "megatrain_min").rglob("*.py"))       # the periphery, its packages (plan/) too


def module_of(path):
    """The module a file of ours is, as the graph names it: "model", "cli", "plan" (plan/__init__.py),
    "plan.fit", "plan.__main__"."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[1:] if rel.parts[0] == "megatrain_min" else rel.parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "megatrain_min"


def ours(name):
    """The module of ours an import names (megatrain_min.x, megatrain_min.x.y, or a core module; the package
    itself: "megatrain_min"), else None."""
    if name in CORE or name == "megatrain_min":
        return name
    if name.startswith("megatrain_min."):
        path = ROOT.joinpath(*name.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return name.removeprefix("megatrain_min.")
    return None


def imported(node, package="megatrain_min"):
    """The modules of ours an Import / ImportFrom node names: `from a.b import c` names a.b.c when c is a
    module of ours, else a.b (relative imports resolved inside `package`, the importing file's)."""
    if isinstance(node, ast.Import):
        return {ours(a.name) for a in node.names}
    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else None
    module = ".".join(filter(None, (base, node.module))) if node.level else node.module
    if module == "megatrain_min" or (module or "").startswith("megatrain_min."):
        return {ours(f"{module}.{a.name}") or ours(module) for a in node.names}
    return {ours(module)}


def imports(path):
    """The modules of ours that the file imports anywhere: top level, in functions, in its __main__ block."""
    package = "megatrain_min." + module_of(path) if path.name == "__init__.py" else \
        ".".join(("megatrain_min." + module_of(path)).split(".")[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= imported(node, package)
    return found - {None}


def graph():
    """{module: the modules of ours it imports}. Every import counts, wherever it stands: a `python -m` shim in
    one module's __main__ block that imports another which imports it back is a cycle a reader walks too.
    (Importing plan.fit runs plan/__init__.py first; that is Python's order, not an arrow of ours.)"""
    files = {module_of(p): p for p in LIBRARY if p != ROOT / "megatrain_min" / "__init__.py"}
    files.update({name: ROOT / f"{name}.py" for name in CORE})
    return {name: imports(path) - {name} for name, path in files.items()}


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_core_file_within_its_budget(name):
    lines = (ROOT / name).read_text().splitlines()
    wide = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > COLUMNS]
    assert len(lines) <= BUDGET[name], f"{name}: {len(lines)} lines, budget {BUDGET[name]}"
    assert not wide, f"{name}: lines wider than {COLUMNS} columns (line, width): {wide}"


def test_model_and_optim_import_nothing_of_ours_and_stream_only_them():
    mine = {name: imports(ROOT / f"{name}.py") - {name} for name in ("model", "optim", "stream")}
    assert mine["model"] == set() and mine["optim"] == set(), mine
    assert mine["stream"] <= {"model", "optim"}, mine["stream"]


def cycle(g):
    """An import cycle of graph g ({module: its imports}) as a list [a, b, ..., a], or None."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for dep in sorted(g.get(node, ())):
            if found := visit(dep):
                return found
        path.pop()
        done.add(node)
        return None

    return next((c for c in map(visit, sorted(g)) if c), None)


def test_import_graph_is_acyclic():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]   # it can see one
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    first = ast.parse("from megatrain_min.plan import fit, PlanError").body[0]    # a package's module, a name
    assert imported(first) == {"plan.fit", "plan"} and "plan.fit" in graph()["train"]
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def private(name):
    return name.startswith("_") and not name.startswith("__")


def private_names(tree):
    """The underscored names a module defines: functions, classes, methods, `self._x` attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and private(node.name):
            names.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and private(node.attr)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name) and private(t.id)}
    return names


def reaches(path, trees):
    """Where file `path` uses another module's underscored name: `x._name` on anything but self / cls where
    _name is defined by another of our modules (and not by this one), or `from ours import _name`."""
    mine = private_names(trees[path])
    theirs = set().union(*(private_names(t) for p, t in trees.items() if p != path)) - mine
    found = []
    for node in ast.walk(trees[path]):
        if isinstance(node, ast.ImportFrom) and imported(node) - {None} and any(private(a.name) for a in node.names):
            found.append(f"{path.name}:{node.lineno}: from {node.module} import _...")
        elif (isinstance(node, ast.Attribute) and node.attr in theirs
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """`trainer._ready()`, `stream._helper`, `from .checks import _x` across our modules: the public surface only."""
    files = LIBRARY + [ROOT / f"{name}.py" for name in sorted(CORE)]
    trees = {p: ast.parse(p.read_text()) for p in files}
    found = [f for p in files for f in reaches(p, trees)]
    assert not found, found
    # the rule can fail: a file that calls another module's private method is caught
    probe = ROOT / "probe.py"
    trees[probe] = ast.parse("from .checks import _hidden\ndef f(trainer):\n    return trainer._ready(0)\n")
    assert len(reaches(probe, trees)) == 2


def test_comments_do_not_narrate_history():
    pattern = re.compile(r"\bissue #?\d+|\bcommit [0-9a-f]{7,40}\b|\bwas\b[^.\n]{0,40}\buntil\b", re.I)
    found = [f"{p.name}:{n}: {line.strip()}" for p in LIBRARY + [ROOT / name for name in BUDGET]
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
