"""Checkpoint files are data, never code, and a bad checkpoint is a one-line message.

A real pickle payload (an object whose `__reduce__` makes the unpickler call `exec`, which would
write a marker file) is planted in the files of a format-2 run the trainer wrote (a tensor item of a
rank's data file, the DCP index `.metadata`, the per-rank extra file, a consolidated.pt) and in an
imported reference checkpoint; every command that reads one (`sample`, `eval`, `convert to-hf`,
`convert consolidate`, `convert from-reference`, resume) must refuse it with a message naming the
file, and the marker must not exist. Damaged files (empty, truncated, random bytes), a missing rank
file, a checkpoint of another model or objective, a truncated meta.json and a `latest` naming a
missing or incomplete step are checked the same way. (Format-1 files, read through DeepSpeed's own
loader: tests/test_checkpoint_format1.py.)
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, cli_env



class Planted:
    """Unpickling this calls exec(code): with weights_only=False it writes `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


def plant(path: Path, marker: Path) -> None:
    obj = torch.load(path, weights_only=False)  # our own file, written by the trainer just before
    if isinstance(obj, dict):
        obj["planted"] = Planted(marker)
    else:
        obj = {"planted": Planted(marker), "value": obj}
    torch.save(obj, path)


DATA = "__0_0.distcp"  # rank 0's data file of a format-2 checkpoint (pretrain/checkpoint/distcp.py)


def plant_item(ckpt: Path, marker: Path, prefix: str = "ema/") -> Path:
    """Replace the first tensor item under `prefix` in the rank-0 data file by a payload (the other
    items moved up, their offsets rewritten in .metadata, which we wrote ourselves just before)."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    f = ckpt / DATA
    data = f.read_bytes()
    items = sorted(md.storage_data.items(), key=lambda kv: kv[1].offset)
    target = next(i for i, _ in items if i.fqn.startswith(prefix))
    out = bytearray()
    for index, info in items:
        chunk = data[info.offset:info.offset + info.length]
        if index == target:
            buf = io.BytesIO()
            torch.save({"planted": Planted(marker)}, buf)
            chunk = buf.getvalue()
        info.offset, info.length = len(out), len(chunk)
        out += chunk
    f.write_bytes(bytes(out))
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    return f


def plant_metadata(ckpt: Path, marker: Path) -> Path:
    f = ckpt / ".metadata"
    md = pickle.loads(f.read_bytes())
    md.storage_meta = Planted(marker)
    f.write_bytes(pickle.dumps(md))
    return f


PLANT = {DATA: plant_item, ".metadata": plant_metadata}


@pytest.fixture
def trained(tiny_run, model_parallel):
    """A tiny run (EMA, ZeRO-0) with checkpoints at steps 2 and 4, and its recipe (conftest.py, shared:
    read it, or copy it with `run`)."""
    return tiny_run


@pytest.fixture
def run(trained, tmp_path):
    """A fresh copy of the trained run (tests damage it)."""
    recipe, src = trained
    dst = tmp_path / "runs" / "tiny"
    shutil.copytree(src, dst)
    return recipe, dst


def step(run_dir: Path, n: int = 4) -> Path:
    return run_dir / "checkpoints" / f"step_{n:08d}"


def one_line_error(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def pretrain(recipe: Path, run_dir: Path, *overrides: str) -> int:
    from launch.cli import main

    return main(["pretrain", "--config", str(recipe), "--out", str(run_dir.parent), *overrides])


# -- planted payloads ---------------------------------------------------------------------------
def test_the_payload_is_real(run, tmp_path):
    """The planted objects do run code under a plain torch.load (so the tests below can fail)."""
    marker = tmp_path / "ran"
    f = step(run[1]) / "extra_rank00000.pt"
    plant(f, marker)
    torch.load(f, weights_only=False)
    assert marker.read_text() == "code ran"
    marker.unlink()
    plant_item(step(run[1]), marker)
    pickle.loads((step(run[1]) / ".metadata").read_bytes())
    plant_metadata(step(run[1]), marker)
    pickle.loads((step(run[1]) / ".metadata").read_bytes())
    assert marker.read_text() == "code ran"
    torch.save({"config": LightningConfig(tmp_path / "setstate")}, tmp_path / "c.pt")
    torch.load(tmp_path / "c.pt", weights_only=False)
    assert (tmp_path / "setstate").read_text() == "setstate ran"


@pytest.mark.parametrize("file", [DATA, ".metadata"])
def test_sample_refuses_a_planted_data_or_index_file(run, tmp_path, capsys, file):
    from eval.sample import main

    marker = tmp_path / "ran"
    PLANT[file](step(run[1]), marker)
    code = main(["--checkpoint", str(run[1]), "--prompt", "x", "--max-new-tokens", "2"])
    one_line_error(capsys, code, file, "refused", "run code")
    assert not marker.exists()


def test_eval_refuses_a_planted_ema_item(run, tmp_path, capsys):
    from eval.cli import main

    marker = tmp_path / "ran"
    plant_item(step(run[1]), marker)
    code = main(["likelihood", "--checkpoint", str(run[1]), "--out", str(tmp_path / "ev"), "--max-batches", "1"])
    one_line_error(capsys, code, DATA, "refused")
    assert not marker.exists()


@pytest.mark.parametrize("command", ["to-hf", "consolidate"])
def test_convert_refuses_a_planted_data_file(run, tmp_path, capsys, command):
    from launch.cli import main

    marker = tmp_path / "ran"
    plant_item(step(run[1]), marker)
    args = ["--checkpoint", str(run[1])] + (["--out", str(tmp_path / "hf")] if command == "to-hf" else [])
    if command == "consolidate":  # an unsharded checkpoint consolidates from the same file
        args += ["--out", str(tmp_path / "c.pt")]
    code = main(["convert", command, *args])
    one_line_error(capsys, code, DATA, "refused")
    assert not marker.exists() and not (tmp_path / "hf").exists() and not (tmp_path / "c.pt").exists()


def test_load_model_refuses_a_planted_consolidated_file(run, tmp_path):
    """A checkpoint that is one consolidated.pt (an imported run's, or a consolidated copy of one)."""
    import json

    from pretrain.checkpoint.inference import load_model
    from pretrain.checkpoint.consolidate import consolidate
    from pretrain.safe_load import CheckpointError

    marker = tmp_path / "ran"
    ckpt = step(run[1])
    f = consolidate(ckpt, out=tmp_path / "consolidated.pt", log=lambda m: None)
    for p in list(ckpt.iterdir()):
        if p.name not in ("meta.json", "COMPLETE", "extra_rank00000.pt"):
            p.unlink()
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "storage"}))
    shutil.move(f, ckpt / "consolidated.pt")
    load_model(run[1])  # as it is: it loads
    plant(ckpt / "consolidated.pt", marker)
    with pytest.raises(CheckpointError, match="consolidated.pt: refused"):
        load_model(run[1])
    assert not marker.exists()


class LightningConfig:
    """Stands for the classes a foreign training checkpoint pickles besides its weights (an OmegaConf
    config, callback states), whose own code runs when a plain unpickler rebuilds them: here its
    `__setstate__` writes `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __setstate__(self, state):
        open(state["marker"], "w").write("setstate ran")


def test_from_reference_reads_the_weights_of_a_lightning_checkpoint_and_runs_nothing(tmp_path, capsys, model_parallel):
    """A Lightning .ckpt whose hyper-parameters hold a payload and an object of a foreign class: the
    weights are imported, the objects are replaced by inert stand-ins (named on stderr), the payload
    never runs."""
    from launch.cli import main
    from test_convert_reference import L, _compare, synthetic_dit

    marker = tmp_path / "ran"
    sd = synthetic_dit(adaln=False)
    f = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"backbone." + k: v for k, v in sd.items()},
                "hyper_parameters": {"config": LightningConfig(tmp_path / "setstate"), "hook": Planted(marker)}}, f)
    code = main(["convert", "from-reference", "--model", str(f), "--out", str(tmp_path / "run"), "--family", "ar",
                 "--seq-len", str(L)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert not marker.exists() and not (tmp_path / "setstate").exists()
    assert "nothing in them ran" in err and "builtins.exec" in err and "LightningConfig" in err, err
    _compare(tmp_path / "run", sd)


def test_from_reference_refuses_objects_in_place_of_weights(tmp_path, capsys):
    from launch.cli import main
    from test_convert_reference import synthetic_dit

    marker = tmp_path / "ran"
    sd = {"backbone." + k: v for k, v in synthetic_dit(adaln=False).items()}
    sd["backbone.blocks.0.attn_qkv.weight"] = Planted(marker)
    torch.save({"state_dict": sd}, tmp_path / "last.ckpt")
    code = main(["convert", "from-reference", "--model", str(tmp_path / "last.ckpt"), "--out", str(tmp_path / "run"),
                 "--family", "ar"])
    one_line_error(capsys, code, "last.ckpt", "refused", "blocks.0.attn_qkv.weight")
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("file", ["extra_rank00000.pt", DATA, ".metadata"])
def test_resume_refuses_a_planted_file(run, tmp_path, capsys, file):
    """extra_rank: read by setdlm; the data file and the index: read through DCP by every rank."""
    recipe, run_dir = run
    marker = tmp_path / "ran"
    if file in PLANT:
        PLANT[file](step(run_dir), marker)
    else:
        plant(step(run_dir) / file, marker)
    code = pretrain(recipe, run_dir, "train.max_steps=6")
    one_line_error(capsys, code, file, "refused")
    assert not marker.exists()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000004"  # nothing new saved


def test_deepspeed_loads_inside_the_guard_are_weights_only(run, tmp_path):
    """Any torch.load DeepSpeed makes while setdlm reads a checkpoint (engine, ZeRO, zero_to_fp32)."""
    from pretrain.safe_load import CheckpointError, restricted_torch_load

    marker = tmp_path / "ran"
    f = step(run[1]) / "extra_rank00000.pt"
    plant(f, marker)
    real = torch.load
    with restricted_torch_load(), pytest.raises(CheckpointError, match="refused"):
        torch.load(f, map_location="cpu", weights_only=False)
    assert not marker.exists()
    assert torch.load is real  # restored on exit


# -- damaged and missing files ------------------------------------------------------------------
DAMAGE = {
    "empty": lambda b: b"",
    "truncated": lambda b: b[: len(b) // 2],
    "random bytes": lambda b: os.urandom(4096),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_sample_names_a_damaged_model_file(run, capsys, kind):
    from eval.sample import main

    f = step(run[1]) / DATA
    f.write_bytes(DAMAGE[kind](f.read_bytes()))
    code = main(["--checkpoint", str(run[1]), "--prompt", "x", "--max-new-tokens", "2"])
    line = one_line_error(capsys, code, DATA)
    assert any(w in line for w in ("empty", "truncated", "damaged")), line


@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_names_a_damaged_file(run, capsys, kind):
    recipe, run_dir = run
    f = step(run_dir) / ("extra_rank00000.pt" if kind == "random bytes" else DATA)
    f.write_bytes(DAMAGE[kind](f.read_bytes()))
    code = pretrain(recipe, run_dir, "train.max_steps=6")
    line = one_line_error(capsys, code, f.name)
    assert any(w in line for w in ("empty", "truncated", "damaged")), line


def test_missing_rank_file(run, capsys):
    from eval.sample import main

    recipe, run_dir = run
    (step(run_dir) / DATA).unlink()
    code = main(["--checkpoint", str(run_dir), "--prompt", "x", "--max-new-tokens", "2"])
    one_line_error(capsys, code, DATA, "missing")
    code = pretrain(recipe, run_dir, "train.max_steps=6")
    one_line_error(capsys, code, "step_00000004", DATA, "incomplete")


@pytest.mark.parametrize("override,field", [("model.hidden=64", "model.hidden"),
                                            ("objective.name=mdlm", "objective.name"),
                                            ("model.rope_base=5000.0", "model.rope_base"),
                                            ("model.norm_eps=0.001", "model.norm_eps"),
                                            ("data.tokenizer=bert-base-uncased", "data.tokenizer"),
                                            ("train.lora={rank: 2, random_base: true}", "train.lora")])
def test_resume_refuses_another_model_objective_or_tokenizer(run, capsys, override, field):
    """The identity a resume checks is derived from every model key that changes what the weights
    compute (model/config.py: all but RUNTIME_KEYS), so rope_base and norm_eps are in it."""
    recipe, run_dir = run
    code = pretrain(recipe, run_dir, override, "train.max_steps=6")
    line = one_line_error(capsys, code, field, "the checkpoint has" if field != "data.tokenizer" else "trained with")
    assert str(step(run_dir)) in line


def test_runtime_keys_may_change_on_resume(run, capsys):
    """Dropout and the attention kernel are not part of a checkpoint's identity: the run continues."""
    recipe, run_dir = run
    assert pretrain(recipe, run_dir, "model.dropout=0.0", "model.attention_backend=sdpa", "train.max_steps=5") == 0


def test_identity_covers_every_model_key_but_the_runtime_ones():
    import dataclasses

    from model.config import RUNTIME_KEYS, ModelConfig, identity_keys

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(identity_keys()) == names - set(RUNTIME_KEYS)
    assert {"rope_base", "norm_eps", "qk_norm", "vocab_size", "head_dim"} <= set(identity_keys())
    assert set(RUNTIME_KEYS) <= names  # no stale name


def test_meta_json_has_a_format_version(run):
    import json

    from pretrain.checkpoint.versions import CURRENT

    assert json.loads((step(run[1]) / "meta.json").read_text())["format_version"] == CURRENT


def test_a_newer_format_is_refused_in_one_line(run, capsys):
    import json

    from eval.sample import main

    f = step(run[1]) / "meta.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "format_version": 99}))
    code = main(["--checkpoint", str(step(run[1])), "--prompt", "x", "--max-new-tokens", "2"])
    one_line_error(capsys, code, "meta.json", "format_version 99 is newer")


def test_an_older_format_with_a_renamed_key_is_migrated(run, capsys, monkeypatch):
    """A synthetic older format: version CURRENT of a make-believe history in which `train.max_steps`
    was called `train.steps`. Its checkpoint loads once the migration from that version is declared,
    and is one line naming the key without it; an unversioned meta.json (written before versions were
    recorded) is version 0 and loads as it is."""
    import json

    from eval.sample import main
    from pretrain.checkpoint import versions

    f = step(run[1]) / "meta.json"
    meta = json.loads(f.read_text())
    old = {**meta, "config": {**meta["config"], "train": {("steps" if k == "max_steps" else k): v
                                                          for k, v in meta["config"]["train"].items()}}}
    f.write_text(json.dumps(old))
    args = ["--checkpoint", str(step(run[1])), "--prompt", "x", "--max-new-tokens", "2"]
    monkeypatch.setattr(versions, "CURRENT", versions.CURRENT + 1)
    one_line_error(capsys, main(args), "meta.json", "too old")  # no migration from that version declared
    monkeypatch.setitem(versions.MIGRATIONS, versions.CURRENT - 1, lambda m: {
        **m, "config": rename_key(m["config"], "train.steps", "train.max_steps")})
    assert main(args) == 0, capsys.readouterr().err
    monkeypatch.setattr(versions, "CURRENT", versions.CURRENT - 1)
    del versions.MIGRATIONS[versions.CURRENT]
    f.write_text(json.dumps(old))  # the same key at the current version: no migration applies
    one_line_error(capsys, main(args), "train.steps")
    f.write_text(json.dumps({k: v for k, v in meta.items() if k != "format_version"}))
    assert main(args) == 0, capsys.readouterr().err


def rename_key(recipe, old, new):
    from common.versions import rename_key as rename

    return rename(recipe, old, new)


def test_truncated_meta_json(run, capsys):
    from eval.sample import main

    meta = step(run[1]) / "meta.json"
    meta.write_text(meta.read_text()[:40])
    code = main(["--checkpoint", str(step(run[1])), "--prompt", "x", "--max-new-tokens", "2"])
    one_line_error(capsys, code, "meta.json", "truncated")


@pytest.mark.parametrize("damage", ["missing step", "no COMPLETE marker", "truncated meta.json"])
def test_resume_falls_back_to_the_newest_complete_checkpoint(run, model_parallel, damage):
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    recipe, run_dir = run
    last = step(run_dir)
    if damage == "missing step":
        shutil.rmtree(last)
    elif damage == "no COMPLETE marker":
        (last / "COMPLETE").unlink()
    else:
        (last / "meta.json").write_text('{"step": 4, "con')
    trainer = Trainer(load_config(recipe, [f"run.out_dir={run_dir.parent}"]))
    assert trainer.maybe_resume() and trainer.step == 2
    assert any("latest" in n and "step_00000002" in n and "newest complete" in n for n in trainer.notes), trainer.notes


def test_latest_with_nothing_complete_is_an_error(run, capsys):
    recipe, run_dir = run
    for s in (2, 4):
        (step(run_dir, s) / "COMPLETE").unlink()
    code = pretrain(recipe, run_dir, "train.max_steps=6")
    one_line_error(capsys, code, "latest", "no complete checkpoint")


def test_disk_full_during_a_save_keeps_the_last_good_checkpoint(run, model_parallel, monkeypatch, capsys):
    """ENOSPC from a save's per-rank file (torch.save of extra_rank*.pt, written in the step loop): the
    partial directory is removed, `latest` and step 4 are untouched, and the run stops with one line
    saying so. (A disk that fills during the background write: tests/test_storage_faults.py.)"""
    recipe, run_dir = run
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if ".tmp-step_00000008" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    before = sorted(p.name for p in step(run_dir).iterdir())
    code = pretrain(recipe, run_dir, "train.max_steps=8", "train.save_every=2")
    line = one_line_error(capsys, code, "step 8", "disk is full", "step_00000006")
    assert "step_00000006" in line
    root = run_dir / "checkpoints"
    assert not list(root.glob(".tmp-*"))
    assert (root / "latest").read_text() == "step_00000006"
    assert sorted(p.name for p in step(run_dir).iterdir()) == before


# -- a model without a process group ------------------------------------------------------------
@pytest.mark.slow
def test_load_model_needs_no_process_group(trained, tmp_path):
    """A fresh interpreter with no launcher variables loads the checkpoint and decodes; afterwards
    torch.distributed is still uninitialised and os.environ is exactly as before."""
    code = (
        "import os, sys, torch\n"
        "import pretrain.checkpoint.inference, model.sampling  # imports first: megatron sets a cache path at import\n"
        "before = dict(os.environ)\n"
        "from pretrain.checkpoint.inference import load_model\n"
        "from model.sampling import SamplingConfig, generate\n"
        "m, tok, cfg = load_model(sys.argv[1])\n"
        "out = generate(m, [tok.encode('The for statement')], SamplingConfig(family='setdlm', window=4,\n"
        "               max_new_tokens=6), mask_id=cfg.model.mask_id, tokenizer=tok)[0]\n"
        "assert len(out.tokens) == 6, out\n"
        "assert not torch.distributed.is_initialized()\n"
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
        "assert not any(k in os.environ for k in ('MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE'))\n"
        "print('decoded', repr(out.text))\n")
    env = cli_env()
    r = subprocess.run([sys.executable, "-c", code, str(trained[1])], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "decoded" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_inference_loads_need_neither_megatron_nor_deepspeed(trained):
    """With megatron-core and DeepSpeed unimportable, a TP=1 checkpoint's run directory, meta.json,
    tokenizer and full weights (EMA included) are read, equal to what the full stack reads, and the model
    loads and decodes."""
    code = (
        "import sys, torch\n"
        "for name in ('megatron', 'megatron.core', 'deepspeed'):\n"
        "    sys.modules[name] = None\n"
        "from pretrain.checkpoint import inference, rundir\n"
        "ckpt = rundir.resolve_checkpoint(sys.argv[1])\n"
        "meta = rundir.read_meta(ckpt)\n"
        "cfg = rundir.read_recipe(ckpt, meta)\n"
        "tok = rundir.checkpoint_tokenizer(ckpt, meta, cfg.data.tokenizer)\n"
        "weights, used_ema = inference.checkpoint_weights(ckpt, meta)\n"
        "assert used_ema and tok.sha256 == meta['tokenizer_sha256']\n"
        "torch.save(weights, sys.argv[2])\n"
        "from model.sampling import SamplingConfig, generate\n"
        "m, tok, cfg = inference.load_model(sys.argv[1])\n"
        "out = generate(m, [tok.encode('The for statement')], SamplingConfig(family='setdlm', window=4,\n"
        "               max_new_tokens=6), mask_id=cfg.model.mask_id, tokenizer=tok)[0]\n"
        "assert len(out.tokens) == 6 and 'deepspeed' not in {k.split('.')[0] for k, v in sys.modules.items() if v}\n"
        "print('decoded')\n")
    out = trained[1].parent / "weights-without-megatron.pt"
    r = subprocess.run([sys.executable, "-c", code, str(trained[1]), str(out)], cwd=REPO, env=cli_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    from pretrain.checkpoint import inference, rundir

    ckpt = rundir.resolve_checkpoint(trained[1])
    want, _ = inference.checkpoint_weights(ckpt, rundir.read_meta(ckpt))
    got = torch.load(out, weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert "decoded" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
def test_cli_prints_one_line_and_debug_keeps_the_traceback(run, tmp_path):
    f = step(run[1]) / DATA
    f.write_bytes(b"")
    cmd = [sys.executable, "-m", "launch.cli", "sample", "--checkpoint", str(run[1]), "--prompt", "x"]
    r = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "empty file" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(cmd, cwd=REPO, env={**cli_env(), "SETDLM_DEBUG": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "Traceback" in r.stderr and "CheckpointError" in r.stderr, r.stderr[-2000:]
