"""The fault matrix: every subcommand against one table of faults.

Each cell runs one subcommand (in this process, as `setdlm` does: launch.cli.main) on what a fault
made of one tiny trained run, prepared data directory and evaluation output, and checks what every
failure must be: exit status 2, exactly one `error:` line naming what is wrong, no traceback (an
exception escaping `main` fails the cell), and, where the command had something to lose, nothing
lost (the last good checkpoint, an existing file, the records). The table lists, per fault, the
subcommands it applies to; a fault that does not apply to a command is absent from the table, so no
cell is skipped at run time (except the storage faults without root, which need real mounts).

Multi-rank faults (a rank dying or failing while others wait) are tested in their own module.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from helpers import write_recipe
from mounts import fill

STEPS = {"max_steps": 4, "save_every": 4, "eval_every": 0, "log_every": 2, "ema": 0.5, "sample_at_end": False,
         "keep_last": 2}


# -- what the faults are made of: one trained run, one prepared directory, one evaluation ------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory, model_parallel):
    from launch.cli import main

    base = tmp_path_factory.mktemp("matrix")
    recipe = write_recipe(base / "r.yaml", train=STEPS)
    assert main(["pretrain", "--config", str(recipe), "--out", str(base / "runs")]) == 0
    data = base / "data"
    assert main(["data", "prepare", "--input", "builtin:pydoc_topics", "--out", str(data), "--seq-len", "32",
                 "--samples-per-shard", "64", "--max-docs", "12", "--val-docs", "2", "--num-proc", "1"]) == 0
    ev = base / "ev"
    assert main(["eval", "likelihood", "--checkpoint", str(base / "runs" / "tiny"), "--out", str(ev),
                 "--max-batches", "1"]) == 0
    hf = base / "hf"
    assert main(["convert", "to-hf", "--checkpoint", str(base / "runs" / "tiny"), "--out", str(hf)]) == 0
    return {"recipe": recipe, "run": base / "runs" / "tiny", "data": data, "ev": ev, "hf": hf}


@dataclass
class Ctx:
    """Where a command reads and writes in one cell (a fault changes some of these)."""
    tmp: Path
    recipe: Path
    run: Path  # a run directory (its own copy)
    data: Path
    ev: Path  # an evaluation output directory (merge writes into it)
    results: Path  # a merged one (frontier reads it)
    hf: Path  # a Hugging Face export (from-hf reads it)
    out_dir: Path  # a directory output that does not exist yet
    out_file: Path  # a file output that does not exist yet (.png: frontier's format comes from it)
    overrides: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    mounts: object = None
    pretrain_run: Path | None = None  # storage faults: the new run directory `pretrain` would make
    keep: list = field(default_factory=list)  # (path, digest) that must be unchanged afterwards


def digest(p: Path) -> str:
    """A content hash of a file or a directory tree (names, link targets and bytes)."""
    h = hashlib.sha256()
    if p.is_file() and not p.is_symlink():
        h.update(p.read_bytes())
        return h.hexdigest()
    for root, dirs, files in os.walk(p):
        dirs.sort()
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
            f = Path(root) / name
            h.update(str(f.relative_to(p)).encode())
            h.update(os.readlink(f).encode() if f.is_symlink() else f.read_bytes())
    return h.hexdigest()


def keep(ctx: Ctx, *paths: Path) -> None:
    ctx.keep += [(p, digest(p)) for p in paths]


# -- the subcommands ----------------------------------------------------------------------------------------
def pretrain(c: Ctx) -> list[str]:
    return ["pretrain", "--config", str(c.recipe), "--out", str(c.run.parent), "train.max_steps=6", *c.overrides]


COMMANDS: dict[str, Callable[[Ctx], list[str]]] = {
    "pretrain": pretrain,
    "sample": lambda c: ["sample", "--checkpoint", str(c.run), "--prompt", "x", "--max-new-tokens", "2",
                         "--out", str(c.out_file)],
    "eval": lambda c: ["eval", "likelihood", "--checkpoint", str(c.run), "--out", str(c.out_dir), "--max-batches", "1"],
    "eval merge": lambda c: ["eval", "merge", str(c.ev)],
    "to-hf": lambda c: ["convert", "to-hf", "--checkpoint", str(c.run), "--out", str(c.out_dir)],
    "from-hf": lambda c: ["convert", "from-hf", "--model", str(c.hf), "--out", str(c.out_dir)],
    "eval frontier": lambda c: ["eval", "frontier", str(c.results), "--x", "nll", "--y", "bpt", "--out", str(c.out_file)],
    "consolidate": lambda c: ["convert", "consolidate", "--checkpoint", str(c.run), "--out", str(c.out_file)],
    "data prepare": lambda c: ["data", "prepare", "--input", "builtin:pydoc_topics", "--out", str(c.out_dir),
                               "--seq-len", "32", "--samples-per-shard", "64", "--max-docs", "4", "--num-proc", "1",
                               *c.overrides],
    "data inspect": lambda c: ["data", "inspect", str(c.data), "--verify"],
}
WRITERS = ("pretrain", "sample", "eval", "to-hf", "from-hf", "consolidate", "data prepare", "eval frontier")
CHECKPOINT_READERS = ("pretrain", "sample", "eval", "to-hf", "consolidate")


# -- the faults ---------------------------------------------------------------------------------------------
def ckpt(c: Ctx, n: int = 4) -> Path:
    return c.run / "checkpoints" / f"step_{n:08d}"


def wrong_kind(c: Ctx) -> None:
    """Outputs of the wrong kind: a file where a directory goes, a directory where a file goes."""
    f = c.tmp / "a-file"
    f.write_text("a user's file\n")
    d = c.tmp / "a-dir"
    d.mkdir()
    (d / "inside.txt").write_text("a user's file\n")
    c.out_dir, c.out_file = f, d
    c.pretrain_run = f / "tiny"  # pretrain --out FILE
    keep(c, f, d)


def read_only(c: Ctx) -> None:
    ro = c.mounts.read_only("ro")
    c.out_dir, c.out_file = ro / "out", ro / "out.png"
    c.ev = c.mounts.read_only("ro-ev", content=c.ev)  # merge writes its results next to the records
    c.pretrain_run = ro / "tiny"


def disk_full(c: Ctx) -> None:
    full = c.mounts.full("full")
    c.out_dir, c.out_file = full / "out", full / "out.png"
    c.pretrain_run = full / "tiny"
    ev = c.mounts.tmpfs("ev-full", "2m")
    shutil.copytree(c.ev, ev / "ev")
    for f in ("metrics.json", "examples.jsonl", "summary.md"):
        (ev / "ev" / f).unlink()
    fill(ev)
    c.ev = ev / "ev"
    keep(c, c.ev / "records.rank00000.jsonl")


def checkpoints_loop(c: Ctx) -> None:
    root = c.run / "checkpoints"
    shutil.move(root, c.run / "moved")
    root.symlink_to(root)  # checkpoints -> checkpoints
    keep(c, c.run / "moved")


def step_outside(c: Ctx) -> None:
    other = c.tmp / "other-run"
    shutil.copytree(c.run, other)
    (c.run / "checkpoints" / "step_00000006").symlink_to(other / "checkpoints" / "step_00000004")
    (c.run / "checkpoints" / "latest").write_text("step_00000006")
    keep(c, other)


def truncated_extra(c: Ctx) -> None:
    f = ckpt(c) / "extra_rank00000.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def zero_byte_extra(c: Ctx) -> None:
    (ckpt(c) / "extra_rank00000.pt").write_bytes(b"")


def meta_without_config(c: Ctx) -> None:
    f = ckpt(c) / "meta.json"
    meta = json.loads(f.read_text())
    del meta["config"]
    f.write_text(json.dumps(meta))


def _edit_manifest(c: Ctx, edit) -> None:
    f = c.data / "manifest.json"
    m = json.loads(f.read_text())
    edit(m)
    f.write_text(json.dumps(m))
    c.overrides = [f"data.source={c.data}", "data.seq_len=32"]
    c.run = c.tmp / "fresh" / "tiny"


def manifest_without_tokenizer(c: Ctx) -> None:
    _edit_manifest(c, lambda m: m.pop("tokenizer"))


def manifest_shard_without_sha(c: Ctx) -> None:
    _edit_manifest(c, lambda m: m["splits"]["train"]["shards"][1].pop("sha256"))


def token_id_past_vocab(c: Ctx, token: int = 65535) -> None:
    """One id past the vocabulary in a shard whose checksums match (so only the id check can see it)."""
    from data_pipeline.shards import decode_shard, encode_shard, read_manifest, sha256_bytes

    m = read_manifest(str(c.data))
    e = m["splits"]["train"]["shards"][0]
    p = c.data / e["path"]
    rows = decode_shard(p.read_bytes(), str(p), e, m["seq_len"], np.dtype(m["dtype"])).copy()
    rows[1, 3] = token
    data = encode_shard(rows, e["first_sample"])
    p.write_bytes(data)
    e.update(bytes=len(data), sha256=sha256_bytes(data))
    (c.data / "manifest.json").write_text(json.dumps(m))
    c.overrides = [f"data.source={c.data}", "data.seq_len=32", "data.verify_checksums=false", "data.shuffle=false"]
    c.run = c.tmp / "fresh" / "tiny"


def token_id_in_padding(c: Ctx) -> None:
    """An id between the vocabulary (50258) and the padded vocabulary the model embeds (50304)."""
    token_id_past_vocab(c, token=50258)


def every_shard_bad(c: Ctx) -> None:
    for f in (c.data / "train").glob("*.tar"):
        f.write_bytes(b"not a tar")
    c.overrides = [f"data.source={c.data}", "data.seq_len=32", "data.skip_bad_shards=true"]
    c.run = c.tmp / "fresh" / "tiny"


def run_json_without_task(c: Ctx) -> None:
    f = c.ev / "run.json"
    run = json.loads(f.read_text())
    del run["task"]
    f.write_text(json.dumps(run))
    keep(c, c.ev / "records.rank00000.jsonl")


def negative_option(c: Ctx) -> None:
    c.overrides = ["--samples-per-shard", "-1"]


def bad_world_size(c: Ctx) -> None:
    c.overrides = ["--dry-run", "--world-size", "0"]


def bad_gpu_memory(c: Ctx) -> None:
    c.overrides = ["--dry-run"]
    c.env = {"SETDLM_GPU_MEMORY_GIB": "-1"}


@dataclass(frozen=True)
class Fault:
    make: Callable[[Ctx], None]
    commands: tuple[str, ...]
    needle: str  # in the error line
    mounts: bool = False


FAULTS = {
    "output of the wrong kind": Fault(wrong_kind, WRITERS, "is a "),
    "read-only output": Fault(read_only, (*WRITERS, "eval merge"), "read-only", mounts=True),
    "full disk": Fault(disk_full, (*WRITERS, "eval merge"), "No space left on device", mounts=True),
    "checkpoints/ is a looping link": Fault(checkpoints_loop, CHECKPOINT_READERS, "loops"),
    "newest step links into another run": Fault(step_outside, CHECKPOINT_READERS, "outside the run"),
    "truncated extra_rank file": Fault(truncated_extra, ("pretrain",), "extra_rank00000.pt: truncated"),
    "zero-byte extra_rank file": Fault(zero_byte_extra, ("pretrain",), "extra_rank00000.pt: empty"),
    # consolidation needs the layout only, not the recipe: the fault does not apply to it
    "meta.json without config": Fault(meta_without_config, ("pretrain", "sample", "eval", "to-hf"), "meta.json"),
    "manifest without tokenizer": Fault(manifest_without_tokenizer, ("pretrain", "data inspect"), "`tokenizer`"),
    "manifest shard without sha256": Fault(manifest_shard_without_sha, ("pretrain", "data inspect"), "sha256"),
    "token id past the vocabulary": Fault(token_id_past_vocab, ("pretrain",),
                                          "token id 65535 of sample 1 is outside the vocabulary"),
    "token id in the padded vocabulary": Fault(token_id_in_padding, ("pretrain",),
                                               "token id 50258 of sample 1 is outside the vocabulary"),
    "every shard bad with skip_bad_shards": Fault(every_shard_bad, ("pretrain",), "every shard of the train split"),
    "run.json without task": Fault(run_json_without_task, ("eval merge",), "`task`"),
    "negative option": Fault(negative_option, ("data prepare",), "--samples-per-shard: must be an integer >= 1"),
    "world size 0": Fault(bad_world_size, ("pretrain",), "--world-size: must be an integer in [1,"),
    "negative SETDLM_GPU_MEMORY_GIB": Fault(bad_gpu_memory, ("pretrain",), "SETDLM_GPU_MEMORY_GIB='-1'"),
}
CELLS = [pytest.param(f, c, id=f"{f} x {c}") for f, fault in FAULTS.items() for c in fault.commands]


def test_every_subcommand_meets_a_fault():
    """The table covers every subcommand, and every subcommand meets more than one fault."""
    used = {c for fault in FAULTS.values() for c in fault.commands}
    assert used == set(COMMANDS), set(COMMANDS) - used
    assert all(sum(c in f.commands for f in FAULTS.values()) >= 2 for c in COMMANDS)


@pytest.mark.parametrize("fault_name,command", CELLS)
def test_fault(world, tmp_path, request, capsys, monkeypatch, fault_name, command):
    from launch.cli import main

    fault = FAULTS[fault_name]
    ctx = Ctx(tmp=tmp_path, recipe=world["recipe"], run=tmp_path / "runs" / "tiny", data=tmp_path / "data",
              ev=tmp_path / "ev", results=world["ev"], hf=world["hf"], out_dir=tmp_path / "out",
              out_file=tmp_path / "out.png")
    shutil.copytree(world["run"], ctx.run)
    shutil.copytree(world["data"], ctx.data)
    shutil.copytree(world["ev"], ctx.ev)
    if fault.mounts:
        ctx.mounts = request.getfixturevalue("mounts")
    fault.make(ctx)
    if command == "pretrain" and ctx.pretrain_run is not None:
        ctx.run = ctx.pretrain_run  # a new run directory on the faulty storage
    for k, v in ctx.env.items():
        monkeypatch.setenv(k, v)
    if ckpt(ctx).is_dir():
        keep(ctx, ckpt(ctx))  # whatever the command met, the checkpoint it read stays as it was
    latest = ctx.run / "checkpoints" / "latest"
    before_latest = latest.read_text() if latest.is_file() else None
    outputs = {p: os.path.lexists(p) for p in (ctx.out_dir, ctx.out_file)}
    if command == "pretrain" and ctx.pretrain_run is not None:
        outputs[ctx.run] = False
    capsys.readouterr()

    code = main(COMMANDS[command](ctx))

    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert fault.needle in lines[0], (fault.needle, lines[0])
    # nothing lost: what the fault left in place is as it was, and no output was half made
    for p, d in ctx.keep:
        assert digest(p) == d, f"{p} changed"
    if before_latest is not None and latest.is_file():
        assert latest.read_text() == before_latest
    for p, existed in outputs.items():
        if not existed:
            assert not os.path.lexists(p), f"{p}: a partial output was left"
    for d in {ctx.out_dir.parent, ctx.run.parent, ctx.run / "checkpoints"}:
        if d.is_dir() and not d.is_symlink():
            assert not [q.name for q in d.iterdir() if q.name.startswith(".") and "tmp" in q.name], list(d.iterdir())
