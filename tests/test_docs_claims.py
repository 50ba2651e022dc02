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


def test_the_family_table_of_the_architecture_doc_is_true():
    """docs/architecture.md's table of each family's mask kind and inference traits: every row it has
    is the registry's (a new family needs no row for the tests to pass)."""
    from model import families

    text = (REPO / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| .*\(`(\w+)`\) \| `(\w+)` \| `(\w+)` \| `(\w+)` \|$", text, re.M)
    assert len(rows) >= 4, "the family table of docs/architecture.md is gone or reshaped"
    for name, mask, inference, decoding in rows:
        spec = families.get(name)
        assert (mask, inference, decoding) == (spec.mask_kind, spec.inference_mask, spec.decoding), name


def test_model_dropout_drops_what_its_description_says():
    """`model.dropout`'s description: each block's attention and MLP outputs, not the embeddings."""
    import torch

    from model.config import ModelConfig
    from model.transformer import Transformer

    desc = ModelConfig.__dataclass_fields__["dropout"].default.description
    assert "attention and MLP outputs" in desc and "none on the embeddings" in desc, desc
    model = Transformer(ModelConfig(n_layers=2, hidden=16, n_heads=2, ffn_hidden=32, vocab_size=16, mask_id=15,
                                    dropout=0.5, max_seq_len=8))
    drops = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(re.fullmatch(r"layers\.\d+\.drop", n) for n in drops), drops


def test_the_loggers_common_log_names_are_those_the_code_asks_for():
    """common/log.py's docstring names the loggers the library asks `get_logger` for."""
    doc = (REPO / "common" / "log.py").read_text().split('"""')[1]
    used = set()
    for pkg in ("common", "data_pipeline", "model", "pretrain", "eval", "serve", "launch"):
        for p in (REPO / pkg).rglob("*.py"):
            for name in re.findall(r"get_logger\(\s*[\"']([\w.]+)[\"']", p.read_text()):
                used.add(name if name.startswith("setdlm.") else f"setdlm.{name}")
    assert used and all(f"``{n}``" in doc for n in used), (sorted(used), doc)
