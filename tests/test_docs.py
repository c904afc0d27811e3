"""The documentation cannot point at nothing: every relative link in README.md, docs/*.md and the tutorials
(tutorials/*.md and the lessons' markdown cells) resolves to a file of the repository, and an #anchor into a
.md file names one of its headings (GitHub's slug rules); every repository path and every
tests/test_x.py::test_name that they quote in backticks exists. The architecture page is docs/design.md: no
file cites the design notes by another name. And every command they name answers --help under that name (slow:
each runs, forked from the runner conftest keeps)."""
import re
from pathlib import Path

import pytest

from conftest import train_py

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "tutorials").glob("*.md")),
         *sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))]

FENCE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n.*?^[ \t]*\1[ \t]*$", re.M | re.S)   # fenced code blocks
CODE = re.compile(r"(`+)(.+?)\1", re.S)                                            # inline code spans
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")   # [t](target)
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)               # [ref]: target
HTML = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")                                 # https:, mailto:, ...
REPO_PATH = re.compile(r"^(?:megatrain_min|tests|tutorials|bench|docs|data|\.ci)/[\w./-]*\w$")
TEST_REF = re.compile(r"(tests/(?:\w+/)?test_\w+\.py)::(\w+)")
OLD_NAME = "design".upper()                  # the design notes' old name, spelled so this file does not hold it


def markdown(path):
    """The markdown of a page: a .md file whole, a lesson's comment lines without their '# '."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        text = "\n".join(re.sub(r"^# ?", "", line) for line in text.splitlines() if line.lstrip().startswith("#"))
    return text


def prose(text):
    """The text with fenced code blocks removed and inline code spans blanked (a link there is not a link)."""
    return CODE.sub(lambda m: "`" + "x" * len(m.group(2)) + "`", FENCE.sub("", text))


def slug(heading):
    """GitHub's anchor for a heading: its text (links as their text, no code ticks or emphasis), lower-cased,
    every character but letters, digits, '_', '-' and spaces dropped, spaces made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    """Every anchor of a markdown file's headings, duplicates numbered as GitHub numbers them (-1, -2, ...)."""
    seen, out = {}, set()
    for _, heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def targets(text):
    clean = prose(text)
    return LINK.findall(clean) + REF_DEF.findall(clean) + HTML.findall(clean)


def broken_links(path, text=None):
    """['page: target (why)'] for each relative link of page `path` that does not resolve."""
    bad = []
    for target in targets(markdown(path) if text is None else text):
        if EXTERNAL.match(target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path.resolve()
        if not dest.exists():
            bad.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def test_every_relative_link_resolves():
    assert len(PAGES) >= 12, PAGES            # README, docs/*, tutorials/README.md and the eleven lessons
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_quoted_paths_and_tests_exist():
    """`megatrain_min/x.py`, `bench/NOTES.md`, tests/test_x.py::test_y ...: what a reader would open."""
    bad = []
    for page in PAGES:
        text = markdown(page)
        for quoted in CODE.findall(FENCE.sub("", text)):
            path = quoted[1].strip()
            if REPO_PATH.match(path) and not ((ROOT / path).exists() or (page.parent / path).exists()):
                bad.append(f"{page.relative_to(ROOT)}: `{path}` does not exist")
        for file, name in TEST_REF.findall(text):
            src = ROOT / file
            if not src.exists() or not re.search(rf"^def {name}\(", src.read_text(), re.M):
                bad.append(f"{page.relative_to(ROOT)}: {file}::{name} does not exist")
    assert not bad, "\n".join(bad)


def test_the_design_notes_are_cited_as_docs_design_md():
    """The word only inside a link to docs/design.md, in every source and documentation file."""
    assert (ROOT / "docs" / "design.md").is_file()
    files = [p for p in ROOT.iterdir() if p.is_file()] + [p for d in ("megatrain_min", "tests", "tutorials", "docs",
                                                                       "bench", ".ci") for p in (ROOT / d).rglob("*")]
    bad = []
    for path in files:
        if not path.is_file() or path.suffix not in ("", ".py", ".md", ".sh", ".txt", ".ini", ".cfg", ".toml"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in LINK.finditer(text):   # links to docs/design.md may say anything
            if (path.parent / m.group(1).partition("#")[0]).resolve() == (ROOT / "docs" / "design.md").resolve():
                text = text.replace(m.group(0), "")
        bad += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
                for m in re.finditer(rf"\b{OLD_NAME}\b", text)]
    assert not bad, f"cite docs/design.md instead: {bad}"


def test_the_checker_catches_what_it_must(tmp_path):
    """The checks above can fail: a missing file, a missing heading, a numbered duplicate heading, a link in
    code that is not a link, and GitHub's slugs of headings with code and punctuation."""
    assert slug("The `--max-context` flag: 7B at 512k!") == "the---max-context-flag-7b-at-512k"
    assert slug("Proving the schedule on a CPU") == "proving-the-schedule-on-a-cpu"
    page = ROOT / "docs" / "x.md"
    text = ("[a](design.md#memory-modes) [b](nope.md) [c](design.md#no-such-heading) `[d](nope2.md)`\n"
            "```\n[e](nope3.md)\n```\n[f](https://example.com/x) [g](../README.md#troubleshooting)")
    assert broken_links(page, text) == ["docs/x.md: nope.md (no such file)",
                                        "docs/x.md: design.md#no-such-heading (no heading #no-such-heading in "
                                        "design.md)"]
    dup = tmp_path / "dup.md"
    dup.write_text("# A\n## Notes\n## Notes\n```\n# not a heading\n```\n")
    assert anchors(dup) == {"a", "notes", "notes-1"}


# ----------------------------------------------------------------------------- every documented command runs
COMMAND = re.compile(r"\b(python3? -m megatrain_min\.(?:hf|sim) [a-z]+|python3? -m megatrain_min\.[a-z_.]+|"
                     r"python3? (?:train|model)\.py|python3? bench/\w+\.py|bash bench/gpu_run\.sh)")


def documented_commands():
    """The project's commands README.md and docs/*.md show, by their names: `python -m megatrain_min.X [sub]`,
    `python train.py`, `python model.py`, the bench scripts, bench/gpu_run.sh (the lessons: tests/test_tutorials.py)."""
    found = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found |= set(COMMAND.findall(page.read_text(encoding="utf-8")))
    return sorted(found)


@pytest.mark.slow
@pytest.mark.parametrize("command", documented_commands())
def test_every_documented_command_runs_under_its_name(command):
    """Each command the README and docs/ name runs under that name: `--help` answers (exit 0), whatever package
    its code moved to -- `python -m megatrain_min.prepare` and `.chat` are the names the commands keep
    (megatrain_min/prepare.py, megatrain_min/chat.py)."""
    import subprocess
    argv = command.split()
    if argv[0] == "bash":
        r = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    elif argv[1] == "-m":      # a fresh process forked from one with torch imported (conftest.train_py)
        r = train_py(*argv[3:], "--help", module=argv[2], timeout=120)
    else:
        r = train_py(*argv[2:], "--help", script=argv[1], timeout=120)
    assert r.returncode == 0, f"{command} --help: exit {r.returncode}\n{r.stderr[-1000:]}"
    if "model.py" not in command:          # model.py takes no flags: it prints the presets
        assert "usage" in r.stdout.lower() or "the command a gpu session runs" in r.stdout.lower(), r.stdout[:500]
