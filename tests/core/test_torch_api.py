"""Every torch name the project's code spells out (torch.X.Y, an alias of a torch module, a name imported from
torch) exists in the torch that runs the tests. .ci/run runs the fast tier under the torch requirements.txt pins
and again under torch 2.11, the oldest supported (what GPU images ship): an API newer than 2.11 --
dist.all_gather_single, torch._C._accelerator_getAllocatorSettings -- then fails here, on a CPU, not on the first
GPU that runs it. Names reached only through getattr(obj, "name", None) are guarded by the code itself."""
import ast
import importlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*ROOT.glob("*.py"), *(ROOT / "megatrain_min").rglob("*.py"), *(ROOT / "bench").glob("*.py"),
                  *(ROOT / "tutorials").glob("*.py")])


def torch_names(tree):
    """{dotted torch name: first line} of the names a module's code uses: chains of attributes on torch or on an
    alias of a torch module, and names imported from torch."""
    alias, names = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                names.setdefault(f"{node.module}.{a.name}", node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.insert(0, inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in alias:
                names.setdefault(".".join([alias[inner.id], *chain]), node.lineno)
    return names


def resolves(dotted):
    """The object a dotted torch name names (the longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for p in parts[k:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(dotted)


def test_every_torch_name_the_code_uses_exists_in_this_torch():
    missing, seen = [], set()
    for path in SOURCES:
        for name, line in torch_names(ast.parse(path.read_text())).items():
            seen.add(name)
            try:
                resolves(name)
            except (ImportError, AttributeError):
                missing.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    print(f"torch {torch.__version__}: {len(seen)} torch names used in {len(SOURCES)} files, {len(missing)} missing")
    assert not missing, f"not in torch {torch.__version__}: " + "; ".join(missing)
    assert len(seen) > 100 and "torch.cuda.cudart" in seen   # the walk found what the engine uses


@pytest.mark.parametrize("code,name", [("import torch.distributed as dist\ndist.all_gather_nothing(a, b)",
                                        "torch.distributed.all_gather_nothing"),
                                       ("import torch\ntorch._C._no_such_call()", "torch._C._no_such_call"),
                                       ("from torch.cuda import no_such_name", "torch.cuda.no_such_name")])
def test_the_check_finds_a_missing_name(code, name):
    names = torch_names(ast.parse(code))
    assert name in names
    with pytest.raises((ImportError, AttributeError)):
        resolves(name)
