"""Mechanical claims of the docs stay true: the README's list of recipes is configs/, and every recipe
key a doc names in backticks (`train.lora.rank`, `model.attention_backend=flex`) is a key of the recipe."""

from __future__ import annotations

import itertools
import re

from helpers import REPO

SECTIONS = ("run", "model", "objective", "data", "train", "parallel", "logging")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_recipes() -> set[str]:
    """The recipe names of the README tree's `configs/` entry (its line and the indented ones after it)."""
    lines = (REPO / "README.md").read_text().split("## Layout", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("configs/"))
    text = lines[start].split(None, 1)[1]
    for ln in lines[start + 1:]:
        if not ln.startswith(" " * 10):
            break
        text += " " + ln.strip()
    text = re.sub(r"\([^)]*\)", "", text)  # "(CPU)", "(fine-tuning)": words about the recipes
    names = set()
    for word in re.findall(r"[a-z0-9][a-z0-9.-]*(?:\{[^}]*\})?[a-z0-9.-]*", text):
        m = re.fullmatch(r"([^{]*)(?:\{([^}]*)\})?(.*)", word)
        parts = [[m.group(1)], m.group(2).split(",") if m.group(2) else [""], [m.group(3)]]
        for a, b, c in itertools.product(*parts):
            name = (a + b + c).removesuffix(".yaml")
            if "-" in name or name == "quickstart":
                names.add(name)
    return names


def test_the_readme_names_every_recipe_and_no_other():
    have = {p.stem for p in (REPO / "configs").glob("*.yaml")}
    named = readme_recipes()
    assert named == have, f"README configs/ line: missing {sorted(have - named)}, not a recipe {sorted(named - have)}"


def recipe_keys() -> set[str]:
    import dataclasses

    from data_pipeline.config import MixtureEntry
    from pretrain.config import LoRAConfig, RecipeConfig

    keys = {f"{s}.{k}" for s, values in RecipeConfig().to_dict().items() for k in values}
    keys |= {f"train.lora.{f.name}" for f in dataclasses.fields(LoRAConfig)}
    keys |= {f"data.mixture.{f.name}" for f in dataclasses.fields(MixtureEntry)}
    return keys


def code_path(name: str) -> bool:
    """`model.sampling.generate`, `model.tp.cross_entropy`, `run.json`: code or files, not recipe keys."""
    first, second = name.split(".")[:2]
    return ((REPO / first / second).is_dir() or (REPO / first / f"{second}.py").is_file()
            or second in ("cfg", "tp", "json", "yaml", "safetensors", "bin", "pt"))


def test_every_recipe_key_a_doc_names_exists():
    keys = recipe_keys()
    pattern = re.compile(r"`(?:[^`]*\s)?((?:%s)\.[a-z_]+(?:\.[a-z_]+)?)(?:[=:\s][^`]*)?`" % "|".join(SECTIONS))
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for key in pattern.findall(line):
                if key not in keys and not any(k.startswith(key + ".") for k in keys) and not code_path(key):
                    bad.append(f"{doc.relative_to(REPO)}:{n}: {key}")
    assert not bad, "docs name recipe keys that do not exist:\n" + "\n".join(bad)
