"""The core reads in one sitting: model.py, stream.py, optim.py and train.py within their line budgets, every
line at most 100 columns -- and the periphery (megatrain_min/, its packages, tutorials/) within the same width;
the import graph of the core and megatrain_min/ acyclic, model.py and optim.py importing nothing of ours and
stream.py only those two; no module reaching into another's underscored names; no comment narrating history
(issue numbers, commit hashes); every default of grad_clip, batch_size, micro_batches, lr and the device written
out in one home; the batch split over ranks and micro-batches checked in one place."""
import ast
import io
import re
import tokenize

import pytest

from conftest import ROOT

# Physical lines: each core file's length when its budget was last set (2026-11-28: 467, 570, 251, 210; together
# 1,498, at most 1,500) plus 10%, room for a reader's experiment (a new activation, a gate, an update rule, a
# schedule: docs/design.md).
BUDGET = {"model.py": 514, "stream.py": 627, "optim.py": 277, "train.py": 231}
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


def wide(path):
    """[(line, width)] of the lines of `path` wider than COLUMNS."""
    lines = path.read_text().splitlines()
    return [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > COLUMNS]


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_core_file_within_its_budget(name):
    lines = (ROOT / name).read_text().splitlines()
    assert len(lines) <= BUDGET[name], (
        f"{name}: {len(lines)} lines, budget {BUDGET[name]}. The budget keeps the core readable in one sitting "
        f"(docs/design.md, 'Line budgets'). Your own fork: raise BUDGET in tests/core/test_core.py. The project: "
        f"move the feature into megatrain_min/ and hand it to the core -- never pack lines to fit.")
    assert not wide(ROOT / name), f"{name}: lines wider than {COLUMNS} columns (line, width): {wide(ROOT / name)}"


# ----------------------------------------------------------------------------- one idea per line
READ_LIKE_THE_CORE = sorted(BUDGET) + [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tutorials").glob("0[1-4]_*.py"))]
# a word a phrase does not end on: a trailing comment that stops at one was cut (its rest on the next line)
DANGLING = {"a", "an", "the", "of", "its", "their", "and", "or", "than"}
SHORT = 12   # a piece of a string broken over lines this short saved no width: the phrase was cut


def string_pieces(src):
    """[(line, text of each piece)] of every implicit concatenation of string literals in src (f-strings too, however
    the running Python tokenizes them)."""
    lines = src.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    at = lambda pos: starts[pos[0] - 1] + pos[1]  # noqa: E731 -- (row, col) -> offset in src
    pieces, runs, fstring = [], [], None
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":            # Python 3.12: an f-string is several tokens
            fstring = tok.start
        elif name == "FSTRING_END":
            pieces.append((fstring[0], src[at(fstring):at(tok.end)]))
            fstring = None
        elif fstring is not None:
            continue
        elif tok.type == tokenize.STRING:
            pieces.append((tok.start[0], tok.string))
        elif tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT) and name != "NEWLINE":
            continue
        else:
            if len(pieces) > 1:
                runs.append(pieces)
            pieces = []
    return runs


def body(literal):
    """The text between a string literal's quotes (its prefix and quotes dropped)."""
    return re.match(r"(?s)^[rRbBuUfF]*('{3}|\"{3}|'|\")(.*)\1$", literal).group(2)


def packed(path):
    """[(line, what)]: the mechanical signs of lines that hold more than one idea -- a condition used as a statement
    (`a and f()`, `f() if c else g()`), a semicolon, more than three names assigned at once from a tuple written out,
    a string broken mid-word or a piece of nothing but spaces, a trailing comment cut mid-phrase."""
    src = path.read_text()
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.BoolOp, ast.IfExp)):
            found.append((node.lineno, "a condition used as a statement: an if reads better"))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and \
                any(isinstance(t, ast.Tuple) and len(t.elts) > 3 for t in node.targets):
            found.append((node.lineno, f"{len(node.value.elts)} names assigned at once"))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.OP and tok.string == ";":
            found.append((tok.start[0], "a semicolon"))
        if tok.type == tokenize.COMMENT and tok.line.strip() != tok.string.strip():   # at the end of a code line
            words = re.findall(r"[\w']+", tok.string)
            if words and (words[-1].lower() in DANGLING or tok.string.rstrip().endswith("'")):
                found.append((tok.start[0], f"a comment cut mid-phrase: {tok.string.strip()!r}"))
    for run in string_pieces(src):
        texts = [body(text) for _, text in run]
        for (line, _), a, b in zip(run, texts, texts[1:]):
            if not a.strip() or not b.strip():
                found.append((line, "a string piece of nothing but spaces"))
            elif a[-1].isalnum() and b[0].isalnum():
                found.append((line, f"a string broken mid-word: {a[-12:]!r} + {b[:12]!r}"))
            elif min(len(a), len(b)) < SHORT:
                found.append((line, f"a string broken mid-phrase: {a[-12:]!r} + {b[:12]!r}"))
    return sorted(found)


@pytest.mark.parametrize("name", READ_LIKE_THE_CORE)
def test_one_idea_per_line(name):
    """The core and lessons 1-4 read in one pass (docs/design.md, "One idea per line"): no line found by `packed`.
    Each finding names its line."""
    found = packed(ROOT / name)
    assert not found, f"{name}: " + "; ".join(f"line {n}: {what}" for n, what in found)


def test_the_packing_finder_finds_each_sign(tmp_path):
    """The finder can fail: each sign, written once in a probe file, is found on its line."""
    probe = tmp_path / "probe.py"
    probe.write_text("guard and guard.reset()\n"                              # 1
                     "x = 1 if guard else 2\n"                                # 2: fine
                     "a if b else c\n"                                        # 3
                     "x = 1; y = 2\n"                                         # 4
                     "a, b, c, d = 1, 2, 3, 4\n"                              # 5
                     "p, q, r = 1, 2, 3\n"                                    # 6: fine
                     "s = ('cpu ' 'adam'\n"                                   # 7
                     "     'w')\n"                                            # 8
                     "t = (f'one {x}'\n"                                      # 9
                     "     ' '\n"                                              # 10
                     "     'two')\n"                                          # 11
                     "u = 1   # unit -> Future of its\n"                       # 12
                     "v = 2   # a whole comment.\n")                          # 13: fine
    assert sorted({n for n, _ in packed(probe)}) == [1, 3, 4, 5, 7, 9, 10, 12], packed(probe)


PERIPHERY = LIBRARY + sorted((ROOT / "tutorials").glob("*.py"))


def test_periphery_within_100_columns():
    """megatrain_min/ (its packages too) and the tutorials' code keep the core's width."""
    assert len(PERIPHERY) > 40, PERIPHERY
    found = {str(p.relative_to(ROOT)): wide(p) for p in PERIPHERY if wide(p)}
    assert not found, f"lines wider than {COLUMNS} columns (line, width): {found}"


# a file of megatrain_min/ is one concept read in one sitting: about 400 lines (the longest: sharded.py, 460;
# record.py, 450)
PERIPHERY_LINES = 460


def test_periphery_files_read_in_one_sitting():
    long = {str(p.relative_to(ROOT)): n for p in LIBRARY
            if (n := len(p.read_text().splitlines())) > PERIPHERY_LINES}
    assert not long, f"over {PERIPHERY_LINES} lines: split by concept: {long}"


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


def package_graph():
    """{package of megatrain_min (or top-level module): the others it imports}: the module graph folded by
    megatrain_min's first level (engine.homes -> engine), the core left out (it sits above them all)."""
    folded = {}
    for module, deps in graph().items():
        if module in CORE or module == "megatrain_min":
            continue
        top = module.split(".")[0]
        folded.setdefault(top, set()).update(d.split(".")[0] for d in deps if d not in CORE and d != "megatrain_min")
        folded[top].discard(top)
    return folded


def test_the_packages_import_one_way():
    """The folders are the architecture: between megatrain_min's packages (engine, data, checkpoints, hf, run, plan,
    sim) and its top-level modules (cli, the command names) imports go one way -- no cycle in the package graph."""
    g = package_graph()
    assert {"engine", "data", "checkpoints", "hf", "run", "plan", "sim", "cli"} <= set(g), sorted(g)
    assert "run" in g["hf"] or "hf" in g["run"]      # the fold sees edges between packages
    found = cycle(g)
    assert found is None, "import cycle between packages: " + " -> ".join(found)


TOP_ENTRIES = 11   # ls megatrain_min: ~10, each a package or a module named for one concept


def test_the_folder_is_the_table():
    """megatrain_min/ holds a few entries, each a package or a module named for one concept; each package opens
    with a docstring that says what it holds and what it does not (docs/design.md's layout is this tree)."""
    entries = sorted(p for p in (ROOT / "megatrain_min").iterdir() if p.name != "__pycache__")
    assert len(entries) <= TOP_ENTRIES, [p.name for p in entries]
    for p in entries:
        if p.is_dir():
            doc = ast.get_docstring(ast.parse((p / "__init__.py").read_text())) or ""
            assert doc.startswith(f"{p.name}/") and ("Not here" in doc or "What it is not" in doc), p.name
        else:
            assert p.suffix == ".py" and ast.get_docstring(ast.parse(p.read_text())), p.name


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


def reaches(path, trees, defined=None):
    """Where file `path` uses another module's underscored name: `x._name` on anything but self / cls where
    _name is defined by another of our modules (and not by this one), or `from ours import _name`. defined:
    {path: private_names of its tree}, made once for many calls."""
    defined = defined or {p: private_names(t) for p, t in trees.items()}
    mine = defined[path]
    theirs = set().union(*(names for p, names in defined.items() if p != path)) - mine
    found = []
    for node in ast.walk(trees[path]):
        if isinstance(node, ast.ImportFrom) and imported(node) - {None} and any(private(a.name) for a in node.names):
            found.append(f"{path.name}:{node.lineno}: from {node.module} import _...")
        elif (isinstance(node, ast.Attribute) and node.attr in theirs
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """`trainer._await_update()`, `stream._helper`, `from .checks import _x` across our modules: the public surface
    only."""
    files = LIBRARY + [ROOT / f"{name}.py" for name in sorted(CORE)]
    trees = {p: ast.parse(p.read_text()) for p in files}
    defined = {p: private_names(t) for p, t in trees.items()}
    found = [f for p in files for f in reaches(p, trees, defined)]
    assert not found, found
    # the rule can fail: a file that calls another module's private method is caught
    probe = ROOT / "probe.py"
    trees[probe] = ast.parse("from .engine.checks import _hidden\ndef f(trainer):\n    return trainer._await_update(0)\n")
    assert len(reaches(probe, trees)) == 2


def test_comments_do_not_narrate_history():
    pattern = re.compile(r"\bissue #?\d+|\bcommit [0-9a-f]{7,40}\b|\bwas\b[^.\n]{0,40}\buntil\b", re.I)
    found = [f"{p.name}:{n}: {line.strip()}" for p in LIBRARY + [ROOT / name for name in BUDGET]
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


# ------------------------------------------------------------------------------ one home per default
SETTINGS = ("grad_clip", "batch_size", "micro_batches", "lr", "device")
# Where each may be given a value: the library's default (what a bare stream.Trainer(cfg, weights) does)
# in stream.py or optim.py, and train.py's recipe where it differs, in cli.RECIPE (with its reason);
# batch_size has no library default, so cli.DEFAULTS is its one home. device: None everywhere, decided
# by optim.resolve_device alone. Everything else takes these (cli.LIBRARY, plan(), ReferenceTrainer, ...).
HOMES = {"grad_clip": {"stream.py:GRAD_CLIP", "megatrain_min/cli.py:RECIPE"},
         "lr": {"optim.py:LR", "megatrain_min/cli.py:RECIPE"},
         "micro_batches": {"stream.py:MICRO_BATCHES"},
         "batch_size": {"megatrain_min/cli.py:DEFAULTS"},
         "device": set()}


def literal(node):
    """A value written out (not None, not a name): 0.0, 3e-3, "cpu", (4, 16), -1."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp):
        return literal(node.operand)
    if isinstance(node, (ast.Tuple, ast.BinOp)):
        return all(literal(n) for n in ast.iter_child_nodes(node) if isinstance(n, ast.expr))
    return False


def default_sites(path, src=None):
    """{setting: {"file:where"}}: every place in `path` that writes out a default of a setting: a parameter's
    default, a module constant named after it (GRAD_CLIP), a keyword or key of a module-level dict (DEFAULTS),
    argparse's set_defaults(...) and add_argument("--flag", default=...)."""
    rel, tree, found = str(path.relative_to(ROOT)), ast.parse(src or path.read_text()), {}

    def add(name, where):
        if name in SETTINGS:
            found.setdefault(name, set()).add(f"{rel}:{where}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            for a, d in pairs:
                if literal(d):
                    add(a.arg, node.name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "set_defaults":
                for k in node.keywords:
                    if literal(k.value):
                        add(k.arg, "set_defaults")
            elif node.func.attr == "add_argument" and node.args and isinstance(node.args[0], ast.Constant):
                flag = str(node.args[0].value).lstrip("-").replace("-", "_")
                if any(k.arg == "default" and literal(k.value) for k in node.keywords):
                    add(flag, "add_argument")
    for node in tree.body:   # module level: constants, and the dicts of defaults
        if not isinstance(node, ast.Assign):
            continue
        names = [t.id for t in node.targets if isinstance(t, ast.Name)] or \
            [e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)]
        values = node.value.elts if isinstance(node.value, ast.Tuple) and len(names) > 1 else [node.value]
        for name, value in zip(names, values):
            if literal(value):
                add(name.lower(), name)
            elif not re.search("DEFAULT|RECIPE|LIBRARY", name):   # a table of bounds (cli.MOST) is none
                continue
            elif isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict":
                for k in value.keywords:
                    if k.arg and literal(k.value):
                        add(k.arg, name)
            elif isinstance(value, ast.Dict):
                for k, v in zip(value.keys, value.values):
                    if isinstance(k, ast.Constant) and literal(v):
                        add(k.value, name)
    return found


def test_every_default_has_one_home():
    """grad_clip, batch_size, micro_batches, lr and the device are written out only in their homes; and the
    rule can fail: a second home is found."""
    files = LIBRARY + [ROOT / f"{name}.py" for name in sorted(CORE)]
    sites = {k: set() for k in SETTINGS}
    for path in files:
        for k, where in default_sites(path).items():
            sites[k] |= where
    assert sites == HOMES, {k: sites[k] ^ HOMES[k] for k in SETTINGS if sites[k] != HOMES[k]}
    probe = "def plan(cfg, batch_size=8, grad_clip=None):\n    pass\nLR = 1e-3\nMOST = dict(lr=1)\n"
    assert default_sites(ROOT / "megatrain_min" / "probe.py", probe) == {
        "batch_size": {"megatrain_min/probe.py:plan"}, "lr": {"megatrain_min/probe.py:LR"}}
    # the device's default is decided once: the engine's resolve_device
    choosing = [p for p in files if 'is_available() else "cpu"' in p.read_text()]
    assert choosing == [ROOT / "optim.py"], choosing


def test_the_batch_split_is_checked_in_one_place():
    """"The batch splits over the ranks, each share into micro-batches" is checks.splits / check_split: no other
    file of the library takes a batch modulo micro-batches or ranks, or words the refusal itself."""
    files = LIBRARY + [ROOT / f"{name}.py" for name in sorted(CORE)]
    found = []
    for path in files:
        src = path.read_text()
        if path.name != "checks.py" and "not divisible by" in src:
            found.append(f"{path.name}: words the refusal")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and path.name != "checks.py":
                right = ast.unparse(node.right)
                if re.search(r"\b(M|micro_batches|world|ranks|N)\b", right):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
