"""The checkpoint format version and its migrations (common/versions.py).

meta.json carries `format_version`; its recipe (`config`) belongs to the same format. Version 1 is the
first versioned format; a meta.json without the key (version 0) was written before versions were
recorded and has the same content. When a recipe key is renamed or a meta field changes, raise
CURRENT and add the migration from the previous version here, e.g.

    MIGRATIONS[1] = lambda meta: {**meta, "config": rename_key(meta["config"], "train.ema", "train.ema_decay")}

and record the recipe keys of the new version in tests/fixtures/recipe_keys.json (tests/test_versions.py
fails when the recipe's keys change and CURRENT does not; an added key with a default migrates by the
identity).
"""

from __future__ import annotations

from common.versions import migrate

from ..safe_load import CheckpointError

KEY = "format_version"
CURRENT = 2
MIGRATIONS = {
    0: lambda meta: meta,  # unversioned: the same content as version 1
    1: lambda meta: meta,  # version 2 adds parallel.cp (default 1: no context parallelism)
}


def migrate_meta(meta: dict, where) -> dict:
    """A checkpoint's meta.json (and its recipe) at the current format version."""
    return migrate(meta, key=KEY, current=CURRENT, migrations=MIGRATIONS, what=f"{where}", error=CheckpointError)
