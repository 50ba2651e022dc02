"""The checkpoint format version and its migrations (common/versions.py).

meta.json carries `format_version`; its recipe (`config`) belongs to the same format. When a recipe key
is renamed or a meta field changes, raise CURRENT and add the migration from the previous version here,
e.g.

    MIGRATIONS[2] = lambda meta: {**meta, "config": rename_key(meta["config"], "train.ema", "train.ema_decay")}

and record the recipe keys of the new version in tests/fixtures/recipe_keys.json (tests/test_versions.py
fails when the recipe's keys change and CURRENT does not; an added key with a default migrates by the
identity). When a weight is renamed (a model refactor), add the map of the version that had the old
names to WEIGHT_RENAMES: every reader of a checkpoint's weights applies the maps from the checkpoint's
own version on (`weight_renames`, common.versions.rename_weights), so older checkpoints keep loading.

The versions:

- 0 (no `format_version`): written before versions were recorded; the same content as version 1.
- 1: DeepSpeed's files (per TP x PP model files, per-DP-rank ZeRO optimizer files) plus setdlm's EMA
  and extra files; read by shards.py (merged in memory) and resume.py (DeepSpeed's own loader under the
  same layout).
- 2: the sharded format of torch.distributed.checkpoint (distcp.py, train_state.py: global tensors
  written as chunks by every rank, read back under any layout), meta.json `storage: dcp`; the recipe
  gains parallel.cp and train.async_save. The migration 1 -> 2 records what a version-1 checkpoint is
  (`storage: deepspeed`, layout cp 1); the files stay as they are and are read as they are.
"""

from __future__ import annotations

from common.versions import migrate, rename_weights

from ..safe_load import CheckpointError

KEY = "format_version"
CURRENT = 2
WRITTEN = "written_format_version"  # set by migrate_meta: the version the files were written with


def _to_v2(meta: dict) -> dict:
    layout = {**(meta.get("layout") or {})}
    layout.setdefault("cp", 1)
    return {**meta, "layout": layout, "storage": meta.get("storage") or "deepspeed"}


MIGRATIONS = {
    0: lambda meta: meta,  # unversioned: the same content as version 1
    1: _to_v2,  # DeepSpeed's files (storage: deepspeed); parallel.cp and train.async_save take their defaults
}

# version v -> {old weight name (or prefix ending in "."): name in version v + 1}
WEIGHT_RENAMES: dict[int, dict[str, str]] = {}


def migrate_meta(meta: dict, where) -> dict:
    """A checkpoint's meta.json (and its recipe) at the current format version; the version its files
    were written with is kept under WRITTEN."""
    written = meta.get(KEY, 0)
    out = migrate(meta, key=KEY, current=CURRENT, migrations=MIGRATIONS, what=f"{where}", error=CheckpointError)
    out[WRITTEN] = written if isinstance(written, int) and not isinstance(written, bool) else CURRENT
    return out


def weight_renames(meta: dict) -> list[dict[str, str]]:
    """The weight-name maps to apply, in order, to the weights of a checkpoint with (migrated) `meta`."""
    return [WEIGHT_RENAMES[v] for v in range(int(meta.get(WRITTEN, CURRENT)), CURRENT) if WEIGHT_RENAMES.get(v)]


def current_names(weights: dict, meta: dict) -> dict:
    """`weights` ({name: tensor} as the checkpoint's version names them) under the current names."""
    for renames in weight_renames(meta):
        weights = rename_weights(weights, renames)
    return weights


def saved_name(name: str, meta: dict) -> str:
    """The name the checkpoint's own version gives the weight called `name` now (the inverse of the maps)."""
    for renames in reversed(weight_renames(meta)):
        back = {new: old for old, new in renames.items()}
        name = next(iter(rename_weights({name: None}, back)))
    return name
