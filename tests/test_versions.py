"""Format versions (common/versions.py, pretrain/checkpoint/versions.py, model/convert/hf_config.py):
migration step by step, newer refused, renamed keys moved; and a guard that the recipe's keys are those
recorded for the current checkpoint version, so a change of the recipe schema cannot land without a
version and a migration."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common.errors import Error
from common.versions import migrate, rename_key
from helpers import REPO

KEYS_FILE = REPO / "tests" / "fixtures" / "recipe_keys.json"


def recipe_keys() -> list[str]:
    """Every dotted key of a recipe (nested sections: train.lora.*, data.mixture[].*)."""
    from data_pipeline.config import MixtureEntry
    from pretrain.config import LoRAConfig, RecipeConfig

    out = []
    for section, values in RecipeConfig().to_dict().items():
        out += [f"{section}.{k}" for k in values]
    out += [f"train.lora.{f.name}" for f in dataclasses.fields(LoRAConfig)]
    out += [f"data.mixture[].{f.name}" for f in dataclasses.fields(MixtureEntry)]
    return sorted(out)


def test_migrate_steps_through_every_version():
    seen = []

    def step(v):
        return lambda r: (seen.append(v), {**r, "trail": r.get("trail", "") + str(v)})[1]

    out = migrate({"x": 1}, key="v", current=3, migrations={0: step(0), 1: step(1), 2: step(2)}, what="rec")
    assert out == {"x": 1, "trail": "012", "v": 3} and seen == [0, 1, 2]
    assert migrate({"v": 3}, key="v", current=3, migrations={}, what="rec") == {"v": 3}


@pytest.mark.parametrize("record,match", [({"v": 4}, "v 4 is newer than this setdlm reads \\(up to 3\\)"),
                                          ({"v": -1}, "whole number"), ({"v": "2"}, "whole number"),
                                          ({"v": True}, "whole number"), ({"v": 1}, "too old")])
def test_bad_versions_are_one_line(record, match):
    with pytest.raises(Error, match=f"^rec: .*{match}"):
        migrate(record, key="v", current=3, migrations={2: lambda r: r}, what="rec")  # from 2 on


def test_rename_key_moves_a_dotted_key_and_copies():
    recipe = {"train": {"steps": 5, "lr": 0.1}, "model": {"hidden": 8}}
    out = rename_key(recipe, "train.steps", "train.max_steps")
    assert out == {"train": {"max_steps": 5, "lr": 0.1}, "model": {"hidden": 8}}
    assert recipe["train"] == {"steps": 5, "lr": 0.1}  # the input is untouched
    assert rename_key(recipe, "train.absent", "train.x") == recipe
    assert rename_key(recipe, "model.hidden", "model.width.value")["model"] == {"width": {"value": 8}}


def test_the_recipe_keys_are_those_of_the_current_checkpoint_version():
    """A recipe key added, removed or renamed changes what checkpoints hold: raise
    pretrain/checkpoint/versions.py CURRENT, add the migration from the previous version (a rename:
    common.versions.rename_key; an added key with a default: the identity), and record the keys of the
    new version in tests/fixtures/recipe_keys.json."""
    from pretrain.checkpoint.versions import CURRENT, MIGRATIONS

    recorded = json.loads(KEYS_FILE.read_text())
    assert str(CURRENT) in recorded, f"record the recipe keys of checkpoint version {CURRENT} in {KEYS_FILE}"
    now = recipe_keys()
    added = sorted(set(now) - set(recorded[str(CURRENT)]))
    removed = sorted(set(recorded[str(CURRENT)]) - set(now))
    assert not added and not removed, (f"the recipe's keys changed (added {added}, removed {removed}) but checkpoint "
                                       f"format version is still {CURRENT}: see this test's docstring")
    assert all(v in MIGRATIONS for v in range(CURRENT)), "every older version needs its migration"


def test_an_export_newer_than_this_code_is_refused(tmp_path):
    from model.convert.errors import ConvertError
    from model.convert.hf_config import FORMAT_VERSION, migrate_export

    assert migrate_export({"setdlm_format_version": FORMAT_VERSION}, "setdlm_format_version", "c.json")
    with pytest.raises(ConvertError, match="c.json: setdlm_format_version 9 is newer"):
        migrate_export({"setdlm_format_version": 9}, "setdlm_format_version", "c.json")
