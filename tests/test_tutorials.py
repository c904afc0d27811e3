"""Every lesson in tutorials/ runs as the reader would run it (`python tutorials/NN_name.py` from the
repository root, a fresh process: conftest's runner forks it with torch already imported) and ends with its own check: exit code 0 and a last line starting "OK".
Lesson 7 needs transformers (a dev dependency) and is skipped without it. Also: tutorials/README.md names
every lesson and no lesson that does not exist."""
import importlib.util
import re
from pathlib import Path

import pytest

from conftest import train_py

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
NEEDS = {"07_finetune_real_checkpoint.py": ("transformers", "tokenizers")}


def test_there_are_eleven_lessons():
    assert [p.name[:2] for p in LESSONS] == [f"{i:02d}" for i in range(1, 12)], [p.name for p in LESSONS]


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs_and_checks(path):
    missing = [m for m in NEEDS.get(path.name, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{path.name} needs {', '.join(missing)} (pip install -r requirements-dev.txt)")
    src = path.read_text()
    assert src.startswith("# %% [markdown]\n# # Lesson"), "a lesson opens with a markdown cell and its title"
    r = train_py(cwd=ROOT, script=path.relative_to(ROOT))      # a fresh process, forked with torch imported
    tail = (r.stdout[-3000:] + "\n--- stderr ---\n" + r.stderr[-3000:])
    assert r.returncode == 0, f"{path.name} exited {r.returncode}\n{tail}"
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("OK"), f"{path.name} did not end with its check line\n{tail}"
    print(f"{path.name}: {last}")


def test_readme_lists_exactly_the_lessons():
    readme = (ROOT / "tutorials" / "README.md").read_text()
    named = set(re.findall(r"\b(\d\d_[a-z0-9_]+\.py)\b", readme))
    assert named == {p.name for p in LESSONS}, named ^ {p.name for p in LESSONS}
