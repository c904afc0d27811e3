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
LIBRARY = sorted((ROOT / "megatrain_min").glob("*.py"))


def ours(name):
    """The module of ours an import names (megatrain_min.x, or a core module), else None."""
    if name in CORE:
        return name
    if name.startswith("megatrain_min.") and (ROOT / "megatrain_min" / f"{name.split('.')[1]}.py").is_file():
        return name.split(".")[1]
    return None


def is_main_block(node):
    """`if __name__ == "__main__":` -- the code `python -m` runs as the module __main__."""
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value == "__main__")


def imports(path, main_block=True):
    """The modules of ours that the file imports anywhere: top level, in functions, and (main_block) in its
    __main__ block."""
    tree = ast.parse(path.read_text())
    if not main_block:
        tree.body = [n for n in tree.body if not is_main_block(n)]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {ours(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "megatrain_min":                      # from megatrain_min import a, b
                found |= {ours(f"megatrain_min.{a.name}") for a in node.names}
            else:
                found.add(ours(node.module))
    return found - {None}


def graph():
    """{module: the modules of ours it imports}. A __main__ block is a node of its own ("data.__main__"): it
    runs as the module __main__ (`python -m megatrain_min.data prepare` imports prepare, which imports data),
    and nothing imports it, so it can close no cycle -- every other import counts, wherever it stands."""
    files = {p.stem: p for p in LIBRARY if p.stem != "__init__"}
    files.update({name: ROOT / f"{name}.py" for name in CORE})
    g = {name: imports(path, main_block=False) - {name} for name, path in files.items()}
    g.update({f"{name}.__main__": imports(path) for name, path in files.items()})
    return g


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
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_no_module_reaches_into_another_modules_private_names():
    """`module._name` or `from module import _name` across our modules: the public surface only."""
    found = []
    for path in LIBRARY + [ROOT / f"{name}.py" for name in sorted(CORE)]:
        tree = ast.parse(path.read_text())
        aliases = {}                       # local name -> our module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({(a.asname or a.name): ours(a.name) for a in node.names if ours(a.name)})
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    if node.module == "megatrain_min" and ours(f"megatrain_min.{a.name}"):
                        aliases[a.asname or a.name] = a.name
                    elif ours(node.module) and a.name.startswith("_"):
                        found.append(f"{path.name}: from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != path.stem):
                found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, found


def test_comments_do_not_narrate_history():
    pattern = re.compile(r"\bissue #?\d+|\bcommit [0-9a-f]{7,40}\b|\bwas\b[^.\n]{0,40}\buntil\b", re.I)
    found = [f"{p.name}:{n}: {line.strip()}" for p in LIBRARY + [ROOT / name for name in BUDGET]
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
