"""The README's layout tree is the true map of the packages: every module is on it, and every file it
names exists (a moved or new module that is not written into the tree fails here)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "data_pipeline", "model", "pretrain", "eval", "serve", "launch", "benchmarks")


def layout_block() -> str:
    text = (REPO / "README.md").read_text()
    assert "## Layout" in text, "README.md has no '## Layout' section"
    return text.split("## Layout", 1)[1].split("```", 2)[1]


def tree_entries() -> tuple[set[str], set[str]]:
    """(files, directories) the tree names, as repository paths."""
    files, dirs, top = set(), set(), None
    for line in layout_block().splitlines():
        if m := re.match(r"^(\S+)(\s|$)", line):  # a top-level entry: `pkg/` or `scripts/x.sh`
            name = m.group(1)
            if name.endswith("/"):
                top = name
                dirs.add(name)
            else:
                files.add(name)
                top = None
        elif top and (m := re.match(r"^  (\S+)(\s|$)", line)):
            (dirs if m.group(1).endswith("/") else files).add(top + m.group(1))
    return files, dirs


def modules() -> set[str]:
    return {p.relative_to(REPO).as_posix() for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def test_every_module_of_the_packages_is_on_the_tree():
    files, dirs = tree_entries()
    covered = lambda m: m in files or any(m.startswith(d) for d in dirs if d.count("/") > 1)  # noqa: E731
    missing = sorted(m for m in modules() if not covered(m))
    assert not missing, f"README.md's layout tree lacks (one line per file): {missing}"


def test_every_file_the_tree_names_exists():
    files, dirs = tree_entries()
    absent = sorted(f for f in files | dirs if not (REPO / f).exists())
    assert not absent, f"README.md's layout tree names files that do not exist: {absent}"

