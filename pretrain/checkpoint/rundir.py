"""The run directory's files: where each thing lives, which checkpoint is current, and its metadata.

    RUN/config.yaml                 resolved recipe
    RUN/tokenizer/                  the tokenizer the run trained with
    RUN/checkpoints/latest          name of the newest complete checkpoint (replaced atomically)
    RUN/checkpoints/best            with train.keep_best: JSON naming the checkpoint with the best
                                    validation metric (tag, step, metric, value, mode); kept out of
                                    keep_last pruning
    RUN/checkpoints/step_00000100/  one checkpoint: meta.json, COMPLETE, and the files of save.py

Everything that reads a run directory (resume, `train.init_from`, consolidate, convert, sample,
eval) finds checkpoints, `meta.json` and the tokenizer through this module. A `latest` pointer that
names a missing or incomplete step is not trusted: the newest complete checkpoint is used instead,
and the fallback is reported. Wherever a checkpoint is named, `RUN:best`, `RUN:latest` and `RUN:STEP`
(`RUN:2000`, `RUN:step_00002000`) select one of a run's checkpoints (`resolve_checkpoint`); `best` is
exact (no fallback: the best checkpoint is the one the validation chose). A `checkpoints/`, `step_*`
or `latest` that is a symbolic link looping or resolving outside the run directory is refused
(`check_run_dir`): setdlm reads, writes and prunes only checkpoints inside the run. Every problem is a
`CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from common.io import atomic_write_text

from ..safe_load import CheckpointError
from . import versions

CHECKPOINTS = "checkpoints"
LATEST = "latest"
BEST = "best"
COMPLETE = "COMPLETE"
META = "meta.json"
CONSOLIDATED = "consolidated.pt"
DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's index of a format-2 checkpoint
TOKENIZER = "tokenizer"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def tokenizer_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / TOKENIZER


def extra_file(ckpt: str | os.PathLike, rank: int) -> Path:
    """Rank `rank`'s RNG states and data position (save.py)."""
    return Path(ckpt) / f"extra_rank{rank:05d}.pt"


def ema_file(ckpt: str | os.PathLike, mp_rank: int) -> Path:
    """The EMA weights of model-parallel rank `mp_rank` (save.py)."""
    return Path(ckpt) / f"ema_mp_rank_{mp_rank:02d}.pt"


def storage(ckpt: str | os.PathLike, meta: dict) -> str:
    """How a checkpoint's tensors are stored: "dcp" (format 2: torch.distributed.checkpoint, distcp.py),
    "consolidated" (one consolidated.pt: an import, or a folder `setdlm convert consolidate` wrote into)
    or "deepspeed" (format 1: DeepSpeed's files, shards.py). meta.json says so from format 2 on; before,
    the files do (a checkpoint of the commit that reserved format 2 says 2 and holds DeepSpeed files)."""
    ckpt = Path(ckpt)
    if meta.get("storage") == "dcp" or (ckpt / DCP_INDEX).is_file():
        return "dcp"
    if not any(ckpt.glob("*model_states.pt")) and (ckpt / CONSOLIDATED).is_file():
        return "consolidated"
    return "deepspeed"


def has_ema(ckpt: str | os.PathLike, meta: dict) -> bool:
    """Whether checkpoint `ckpt` holds EMA weights (any format)."""
    ckpt = Path(ckpt)
    kind = storage(ckpt, meta)
    if kind == "dcp":
        from .distcp import read_metadata

        return any(k.startswith("ema/") for k in read_metadata(ckpt).state_dict_metadata)
    if any(ckpt.glob("ema_mp_rank_*.pt")):
        return True
    return (ckpt / CONSOLIDATED).is_file() and bool(((meta.get("config") or {}).get("train") or {}).get("ema"))


def run_of(ckpt: str | os.PathLike) -> Path:
    """The run directory that holds checkpoint folder `ckpt` (RUN/checkpoints/step_N)."""
    return Path(ckpt).parent.parent


def step_of(ckpt: str | os.PathLike) -> int | None:
    """N of a step_N folder (None for another name)."""
    name = Path(ckpt).name
    digits = name[len("step_"):]
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


# -- links -------------------------------------------------------------------------------------------
def _link_problem(p: Path, run: Path) -> str | None:
    """Why entry `p` of run directory `run` cannot be used (a symbolic link that loops, dangles or
    resolves outside `run`), or None."""
    if not p.is_symlink():
        return None
    try:
        target = p.resolve(strict=True)
    except (OSError, RuntimeError):  # RuntimeError: a loop, on older Pythons
        return f"a symbolic link that loops or points nowhere ({os.readlink(p)})"
    base = run.resolve()
    if target != base and base not in target.parents:
        return f"a symbolic link to {target}, outside the run directory {base}"
    return None


def _refuse_link(p: Path, why: str) -> CheckpointError:
    fix = "remove the link" if "loops" in why else "replace the link by the directory itself (a copy)"
    return CheckpointError(f"{p}: {why}; setdlm reads, writes and prunes only checkpoints inside the run directory: "
                           f"{fix}")


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """Refuse a run directory whose checkpoints/, a step_* in it or `latest` is a symbolic link that
    loops or resolves outside the run, or whose checkpoints/ is not a directory."""
    run = Path(run_dir)
    root = checkpoints_dir(run)
    why = _link_problem(root, run)
    if why is None and root.exists() and not root.is_dir():
        why = "not a directory"
    if why:
        raise _refuse_link(root, why)
    if root.is_dir():
        for p in [*sorted(root.glob("step_*")), root / LATEST]:
            why = _link_problem(p, run)
            if why:
                raise _refuse_link(p, why)


# -- meta.json -------------------------------------------------------------------------------------
def read_meta(ckpt: str | os.PathLike, *, require: tuple[str, ...] = ("step", "config")) -> dict:
    """`meta.json` of checkpoint folder `ckpt`; CheckpointError when it is missing, truncated, not an
    object, or lacks a key of `require` (setdlm's checkpoints have `step` and `config`)."""
    f = Path(ckpt) / META
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing (not a setdlm checkpoint, or an incomplete copy)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable or truncated ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("layout", {}), dict):
        raise CheckpointError(f"{f}: not a setdlm checkpoint's metadata")
    meta = versions.migrate_meta(meta, f)  # an older format's keys under their current names; a newer one refused
    if any(k not in meta for k in require) or ("config" in require and not isinstance(meta["config"], dict)):
        need = " and ".join(f"`{k}`" for k in require)
        raise CheckpointError(f"{f}: not a setdlm checkpoint's metadata (needs {need})")
    return meta


def write_meta(ckpt: str | os.PathLike, meta: dict) -> None:
    """meta.json, stamped with the current format version (pretrain/checkpoint/versions.py)."""
    meta = {versions.KEY: versions.CURRENT, **{k: v for k, v in meta.items() if k != versions.KEY}}
    atomic_write_text(Path(ckpt) / META, json.dumps(meta, indent=1, default=str))


def read_recipe(ckpt: str | os.PathLike, meta: dict):
    """The RecipeConfig a checkpoint was trained with (from its meta.json)."""
    from ..config import from_dict

    try:
        return from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(ckpt) / META}: its recipe is not valid here ({e})") from None


# -- which checkpoint --------------------------------------------------------------------------------
def is_complete(ckpt: str | os.PathLike) -> bool:
    """A finished save: the COMPLETE marker and a readable meta.json."""
    if not (Path(ckpt) / COMPLETE).is_file():
        return False
    try:
        read_meta(ckpt, require=())
    except CheckpointError:
        return False
    return True


def mark_complete(ckpt: str | os.PathLike) -> None:
    (Path(ckpt) / COMPLETE).touch()


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete step_* checkpoints under `root` (a checkpoints/ folder), oldest first."""
    root = Path(root)
    return sorted(p for p in root.glob("step_*")
                  if p.is_dir() and _link_problem(p, root.parent) is None and is_complete(p))


def latest_tag(root: str | os.PathLike) -> str | None:
    """What `latest` says (None when there is no readable pointer)."""
    try:
        return (Path(root) / LATEST).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def point_latest(root: str | os.PathLike, tag: str) -> None:
    atomic_write_text(Path(root) / LATEST, tag)


def latest_checkpoint(root: str | os.PathLike, notes: list[str] | None = None) -> Path | None:
    """The checkpoint `latest` names; when that is missing or incomplete, the newest complete one
    (saying so in `notes`, a list the caller prints). None when there is no `latest` pointer."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    why = _link_problem(root, root.parent) or _link_problem(pointer, root.parent)
    if why:
        raise _refuse_link(root if root.is_symlink() else pointer, why)
    tag = latest_tag(root) or ""
    path = root / tag
    if tag and "/" not in tag and is_complete(path):
        why = _link_problem(path, root.parent)
        if why:
            raise _refuse_link(path, why)
        return path
    why = ("is empty or unreadable" if not tag else
           f"names {tag}, which is missing" if not path.is_dir() else
           f"names {tag}, which is incomplete (no {COMPLETE} marker or unreadable {META})")
    done = complete_checkpoints(root)
    if not done:
        raise CheckpointError(f"{pointer}: {why}, and there is no complete checkpoint in {root}; "
                              f"remove {root} to start the run afresh")
    if notes is not None:
        notes.append(f"checkpoint: {pointer} {why}; using the newest complete checkpoint, {done[-1]}")
    return done[-1]


# -- the best checkpoint (train.keep_best) -----------------------------------------------------------
def point_best(root: str | os.PathLike, record: dict) -> None:
    """Record checkpoint `record["tag"]` as the run's best (`record`: tag, step, metric, value, mode)."""
    atomic_write_text(Path(root) / BEST, json.dumps(record, indent=1))


def best_record(root: str | os.PathLike) -> dict | None:
    """What `best` records (None when the run has no readable `best`)."""
    try:
        record = json.loads((Path(root) / BEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("tag"), str) else None


def best_tag(root: str | os.PathLike) -> str | None:
    record = best_record(root)
    return record["tag"] if record else None


def best_checkpoint(root: str | os.PathLike) -> Path:
    """The checkpoint `best` names (CheckpointError when there is none or it is not complete)."""
    root = Path(root)
    record = best_record(root)
    if record is None:
        why = "unreadable" if (root / BEST).exists() else "missing"
        raise CheckpointError(f"{root / BEST}: {why}: the run kept no best checkpoint (train.keep_best: true with "
                              "train.eval_every > 0 keeps one); name a checkpoint instead (RUN, RUN:latest, RUN:STEP)")
    path = root / record["tag"]
    if "/" in record["tag"] or not is_complete(path):
        raise CheckpointError(f"{root / BEST}: names {record['tag']}, which is missing or incomplete")
    return path


# -- naming a checkpoint -----------------------------------------------------------------------------
SELECTORS = (BEST, LATEST)


def split_selector(path: str | os.PathLike) -> tuple[Path, str | None]:
    """`RUN:best` -> (RUN, "best"); `RUN:2000` / `RUN:step_00002000` -> (RUN, "step_00002000");
    `RUN:latest` -> (RUN, "latest"); a path that exists as written, or has no such suffix, -> (path, None)."""
    text = os.fspath(path)
    p = Path(text)
    if p.exists() or ":" not in text:
        return p, None
    base, _, sel = text.rpartition(":")
    if sel in SELECTORS:
        return Path(base), sel
    if sel.isdigit():
        return Path(base), tag_for(int(sel))
    if sel.startswith("step_") and sel[5:].isdigit():
        return Path(base), sel
    return p, None


def _select(run: Path, sel: str, notes: list[str] | None) -> Path:
    root = next((r for r in (checkpoints_dir(run), run) if r.is_dir() and (r / LATEST).exists()), None)
    if root is None:
        raise CheckpointError(f"checkpoint {run}:{sel}: {run} is not a run directory (no {CHECKPOINTS}/{LATEST})")
    check_run_dir(root.parent)  # as plain RUN: a step link that loops or leaves the run is refused by name
    if sel == BEST:
        path = best_checkpoint(root)
    elif sel == LATEST:
        return resolve_checkpoint(root, notes)
    else:
        path = root / sel
        if not is_complete(path):
            have = ", ".join(c.name for c in complete_checkpoints(root)[-4:]) or "none"
            raise CheckpointError(f"checkpoint {run}:{sel}: no complete checkpoint {path} (complete: {have})")
    why = _link_problem(path, root.parent)
    if why:
        raise _refuse_link(path, why)
    return path


def names_run_or_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` names a run or a checkpoint (RUN:SELECTOR, a folder with meta.json or checkpoints/),
    rather than, say, prepared data."""
    p, sel = split_selector(path)
    return sel is not None or (p / META).is_file() or (p / CHECKPOINTS).is_dir()


def resolve_checkpoint(path: str | os.PathLike, notes: list[str] | None = None) -> Path:
    """One checkpoint folder from a run directory, its checkpoints/ folder, or the folder itself; or
    `RUN:best`, `RUN:latest`, `RUN:STEP` (`split_selector`). When `latest` is broken, the newest
    complete checkpoint is used and the fallback is reported in `notes` (printed to stderr when no
    list is given)."""
    p, sel = split_selector(path)
    if sel is not None:
        if not p.exists():
            raise CheckpointError(f"checkpoint {p}: no such file or directory")
        return _select(p, sel, notes)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p}: no such file or directory")
    if (p / META).is_file():
        return p
    if p.is_dir():
        check_run_dir(p)  # a looping checkpoints/, or one that leaves the run: refused by name
    for root in (checkpoints_dir(p), p):
        if (root / LATEST).is_file():
            said: list[str] = []
            found = latest_checkpoint(root, notes=said)
            if notes is not None:
                notes += said
            else:
                for line in said:
                    print(f"setdlm: {line}", file=sys.stderr)
            if found is not None:
                return found
    raise CheckpointError(f"checkpoint {p}: not a run directory or checkpoint (no {CHECKPOINTS}/{LATEST} or {META})")


# -- the tokenizer ---------------------------------------------------------------------------------
def tokenizer_location(ckpt: str | os.PathLike, recipe_tokenizer: str) -> str:
    """Where the tokenizer of checkpoint `ckpt` is: its run's saved copy (RUN/tokenizer), else the
    recipe's `data.tokenizer`."""
    d = tokenizer_dir(run_of(ckpt))
    return str(d) if d.is_dir() else recipe_tokenizer


def check_tokenizer(tokenizer, meta: dict, ckpt: str | os.PathLike) -> None:
    """CheckpointError when `tokenizer` is not the one the checkpoint was trained with (sha256 in meta)."""
    want = meta.get("tokenizer_sha256")
    if want and tokenizer.sha256 != want:
        raise CheckpointError(f"checkpoint {ckpt}: tokenizer {tokenizer.name!r} (sha256 {tokenizer.sha256[:12]}) is "
                              f"not the one it was trained with ({want[:12]})")


def checkpoint_tokenizer(ckpt: str | os.PathLike, meta: dict, recipe_tokenizer: str):
    """The tokenizer checkpoint `ckpt` was trained with, checked against its sha256. A built-in one
    (`gpt2`, ...) named by the recipe is used when it matches (built from package files, cached)."""
    from data_pipeline.tokenizers import BUILTIN, load_tokenizer

    want = meta.get("tokenizer_sha256")
    if want and recipe_tokenizer in BUILTIN:
        tok = load_tokenizer(recipe_tokenizer)
        if tok.sha256 == want:
            return tok
    tok = load_tokenizer(tokenizer_location(ckpt, recipe_tokenizer))
    check_tokenizer(tok, meta, ckpt)
    return tok
