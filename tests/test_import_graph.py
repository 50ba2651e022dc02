"""The package layering of README.md: data_pipeline -> model -> pretrain -> eval -> serve -> launch.

A package imports only itself and packages to its left, at module level or inside functions
(a static scan of every import statement, relative imports resolved)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from helpers import REPO

ORDER = ("data_pipeline", "model", "pretrain", "eval", "serve", "launch")


def imported_packages(path: Path, root: Path) -> set[tuple[str, int]]:
    """(first-party package, line) of every import statement in `path` (a file under `root`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root).parts[:-1])  # the package the file belongs to
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `.` is this package, each further dot one level up
                base = package[: len(package) - (node.level - 1)]
                names = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                names = [node.module or ""]
        else:
            continue
        out |= {(n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in ORDER}
    return out


def violations(root: Path = REPO) -> list[str]:
    found = []
    for i, package in enumerate(ORDER):
        allowed = set(ORDER[: i + 1])
        for f in sorted((root / package).rglob("*.py")):
            for target, line in sorted(imported_packages(f, root)):
                if target not in allowed:
                    found.append(f"{f.relative_to(root)}:{line} imports {target}")
    return found


def test_no_package_imports_one_to_its_right():
    assert violations() == []


def test_the_scan_sees_imports_inside_functions_and_relative_ones(tmp_path):
    for package in ORDER:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    probe = tmp_path / "model" / "sampling" / "probe.py"
    probe.write_text("import data_pipeline\nfrom . import api\n\n\ndef f():\n    from pretrain import checkpoint\n"
                     "    from ...eval import runner\n    import launch.env\n")
    assert {t for t, _ in imported_packages(probe, tmp_path)} == {"data_pipeline", "model", "pretrain", "eval", "launch"}
    assert violations(tmp_path) == [f"model/sampling/probe.py:{n} imports {p}" for n, p in
                                    ((7, "eval"), (8, "launch"), (6, "pretrain"))]
