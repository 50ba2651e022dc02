"""Every `from setdlm_package import name` in the tree resolves, including those inside functions
(deferred imports run only on the path that needs them, so a moved module or a renamed function
would otherwise fail first in a user's run)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "data_pipeline", "model", "pretrain", "eval", "serve", "launch")


def _resolves(module: str, name: str | None) -> str | None:
    try:
        m = importlib.import_module(module)
    except ImportError as e:
        return f"{module}: {e}"
    if name is None or name == "*" or hasattr(m, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return f"{module} has no {name}"
    return None


def test_every_from_import_of_the_packages_resolves():
    bad = []
    for top in (*PACKAGES, "tests", "benchmarks", "scripts"):
        for f in sorted((REPO / top).rglob("*.py")):
            if "hf_code" in f.parts:  # shipped inside exports, imported by transformers as a package of its own
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level == 0 and node.module and node.module.split(".")[0] in PACKAGES:
                    module = node.module
                elif node.level > 0 and top in PACKAGES:
                    parts = f.relative_to(REPO).with_suffix("").parts[:-node.level]
                    module = ".".join(parts) + (f".{node.module}" if node.module else "")
                else:
                    continue
                for alias in node.names:
                    if (why := _resolves(module, alias.name)) is not None:
                        bad.append(f"{f.relative_to(REPO)}:{node.lineno}: {why}")
    assert not bad, "imports that no longer resolve:\n" + "\n".join(bad)
