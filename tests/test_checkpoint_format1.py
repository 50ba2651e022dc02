"""Old checkpoints still load: a frozen format-1 checkpoint (tests/fixtures/checkpoint_format1, DeepSpeed's
files, ZeRO-1, EMA, step 2 of a 3-step run, written by commit fbaa6c1: make_fixture.py there) goes
through the migration chain (pretrain/checkpoint/versions.py) into load_model, the Hugging Face export
and resume (the same layout through DeepSpeed's loader, another layout from its shards merged in
memory), and continues the uninterrupted run's step 3. An unversioned (format-0) meta.json, the same
content, loads the same; a weight renamed since format 1 travels by a conversion map in the chain."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import REPO, read_metrics

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_format1"
STEP = "step_00000002"


@pytest.fixture
def run(tmp_path) -> Path:
    dst = tmp_path / "format1"
    shutil.copytree(FIXTURE / "format1", dst)
    return dst


def overrides(run: Path) -> list[str]:
    return [f"run.out_dir={run.parent}", f"run.name={run.name}", f"data.tokenizer={run / 'tokenizer'}"]


def saved(run: Path) -> dict:
    """The fixture's weights and EMA as its files hold them (read here as plain weights-only files)."""
    ckpt = run / "checkpoints" / STEP
    module = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    ema = torch.load(ckpt / "ema_mp_rank_00.pt", weights_only=True)["shadow"]
    return {"module": module, "ema": ema}


def test_meta_migrates_from_format_1_and_0(run):
    from pretrain.checkpoint import rundir, versions

    ckpt = run / "checkpoints" / STEP
    raw = json.loads((ckpt / "meta.json").read_text())
    assert raw["format_version"] == 1 and "cp" not in raw["layout"]
    meta = rundir.read_meta(ckpt)
    assert meta["format_version"] == versions.CURRENT and meta[versions.WRITTEN] == 1
    assert meta["storage"] == "deepspeed" and meta["layout"]["cp"] == 1 and rundir.storage(ckpt, meta) == "deepspeed"
    (ckpt / "meta.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "format_version"}))
    meta0 = rundir.read_meta(ckpt)
    assert meta0[versions.WRITTEN] == 0 and meta0["storage"] == "deepspeed" and meta0["layout"]["cp"] == 1


@pytest.mark.parametrize("version", [1, 0])
def test_load_model_reads_it(run, version):
    from pretrain.checkpoint.inference import load_model

    meta_file = run / "checkpoints" / STEP / "meta.json"
    if version == 0:
        meta_file.write_text(json.dumps({k: v for k, v in json.loads(meta_file.read_text()).items()
                                         if k != "format_version"}))
    model, tok, cfg = load_model(run)
    want = saved(run)
    got = model.state_dict()
    assert set(want["ema"]) <= set(got) and all(torch.equal(got[k], want["ema"][k]) for k in want["ema"])
    model, _, _ = load_model(run, ema=False)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want["module"].items() if torch.is_tensor(v))
    assert tok.decode(tok.encode("for x in y")) == "for x in y"


@pytest.mark.slow
def test_it_exports_and_the_export_imports_back(run, tmp_path):
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.export import export_checkpoint
    from pretrain.convert.from_hf import import_hf

    hf = export_checkpoint(run, tmp_path / "hf", log=lambda s: None)
    assert (hf / "config.json").is_file()
    back, _, _ = load_model(import_hf(hf, tmp_path / "back", log=lambda s: None))
    want, _, cfg = load_model(run)
    a, b = back.state_dict(), want.state_dict()
    real = cfg.model.vocab_size  # the export leaves out the padding rows of the vocabulary
    assert all(torch.equal(a[k][:real] if k == "embed.weight" else a[k], b[k][:real] if k == "embed.weight" else b[k])
               for k in b if torch.is_tensor(b[k]))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["same", "zero0"])
def test_resume_continues_the_uninterrupted_run(run, model_parallel, layout):
    """Step 3 after resuming at step 2 is the uninterrupted run's step 3: exactly through DeepSpeed's
    loader under the layout it was saved with (ZeRO-1), and to float rounding under ZeRO-0 (its shards
    merged in memory: no consolidated.pt written); the new checkpoint is format 2."""
    from pretrain.checkpoint import rundir
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    more = [] if layout == "same" else ["parallel.zero_stage=0"]
    Trainer(load_config(run / "config.yaml", overrides(run) + more)).train()
    want = {json.loads(line)["step"]: json.loads(line) for line in
            (FIXTURE / "uninterrupted_metrics.jsonl").read_text().splitlines()}
    got = read_metrics(run)
    if layout == "same":
        assert got[3]["train/loss"] == want[3]["train/loss"], (got[3], want[3])
    else:
        assert abs(got[3]["train/loss"] - want[3]["train/loss"]) <= 1e-5 * abs(want[3]["train/loss"])
    assert abs(got[3]["train/grad_norm"] - want[3]["train/grad_norm"]) <= 1e-5 * want[3]["train/grad_norm"]
    new = run / "checkpoints" / "step_00000003"
    assert rundir.storage(new, rundir.read_meta(new)) == "dcp"
    assert not list(run.rglob("consolidated.pt"))


@pytest.mark.slow
def test_a_renamed_weight_migrates_by_its_map(run, model_parallel, monkeypatch):
    """A make-believe history: format 1 called the final norm `ln_f`. The fixture's files are rewritten
    with that name; without the conversion map they are refused (the weights do not match the model),
    with WEIGHT_RENAMES[1] they load as before, and the run resumes (through the merged shards: DeepSpeed's
    own loader matches names as saved) and saves format 2 under the current names."""
    from pretrain.checkpoint import versions
    from pretrain.checkpoint.distcp import whole_state
    from pretrain.checkpoint.inference import load_model
    from pretrain.config import load_config
    from pretrain.safe_load import CheckpointError
    from pretrain.trainer import Trainer

    want, _, _ = load_model(run)
    ckpt = run / "checkpoints" / STEP

    def old(name: str) -> str:
        return "ln_f." + name[len("final_norm."):] if name.startswith("final_norm.") else name

    model_file = ckpt / "mp_rank_00_model_states.pt"
    state = torch.load(model_file, weights_only=False)
    state["module"] = {old(k): v for k, v in state["module"].items()}
    state["param_shapes"] = [{old(k): v for k, v in g.items()} for g in state["param_shapes"]]
    state["shard"]["partition"] = {old(k): v for k, v in state["shard"]["partition"].items()}
    torch.save(state, model_file)
    optim_file = ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim = torch.load(optim_file, weights_only=False)
    osd = optim["optimizer_state_dict"]
    osd["param_slice_mappings"] = [{old(k): v for k, v in g.items()} for g in osd["param_slice_mappings"]]
    torch.save(optim, optim_file)
    ema = torch.load(ckpt / "ema_mp_rank_00.pt", weights_only=True)
    ema["shadow"] = {old(k): v for k, v in ema["shadow"].items()}
    torch.save(ema, ckpt / "ema_mp_rank_00.pt")

    with pytest.raises(CheckpointError, match="final_norm"):
        load_model(run)
    monkeypatch.setitem(versions.WEIGHT_RENAMES, 1, {"ln_f.": "final_norm."})
    got, _, _ = load_model(run)
    a, b = got.state_dict(), want.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b if torch.is_tensor(b[k]))
    Trainer(load_config(run / "config.yaml", overrides(run))).train()
    new = whole_state(run / "checkpoints" / "step_00000003")
    assert "final_norm.weight" in new["module"] and not any(k.startswith("ln_f.") for k in new["module"])
