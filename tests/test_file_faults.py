"""Every file the stack reads is checked or named: RNG/extra files, manifests, run.json and
units.json with missing keys, links that loop or leave the run, token ids outside the vocabulary
with verification off, every shard bad, and code shipped with a downloaded tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import REPO, setdlm


def make_checkpoint(root: Path, step: int, complete: bool = True, files=("mp_rank_00_model_states.pt",)) -> Path:
    """A checkpoint folder as the file layer sees it (no weights: pruning and links need none)."""
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(b"weights")
    (d / "meta.json").write_text(json.dumps({"step": step, "config": {}}))
    if complete:
        (d / "COMPLETE").touch()
    return d


# -- RNG / extra files ----------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [{"data": {}}, {"rng": {"python": 1}}, [1, 2]], ids=["no rng", "bad rng", "a list"])
def test_an_extra_file_without_its_rng_state_is_named(tmp_path, content):
    from pretrain.checkpoint.resume import checked_extra
    from pretrain.safe_load import CheckpointError

    f = tmp_path / "extra_rank00000.pt"
    torch.save(content, f)
    with pytest.raises(CheckpointError, match="extra_rank00000.pt: "):
        checked_extra(f)


def test_a_truncated_extra_file_is_named_not_errno_22(tmp_path):
    from pretrain.checkpoint.rng import rng_state
    from pretrain.safe_load import CheckpointError, load

    f = tmp_path / "extra_rank00000.pt"
    torch.save({"rng": rng_state(), "data": {}}, f)
    f.write_bytes(f.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match=r"extra_rank00000.pt: truncated or damaged"):
        load(f)


# -- manifests, run.json, units.json --------------------------------------------------------------------
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep") / "data"
    r = setdlm("data", "prepare", "--input", "builtin:pydoc_topics", "--out", d, "--seq-len", "32",
               "--samples-per-shard", "64", "--max-docs", "8", "--num-proc", "1")
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.parametrize("drop", ["tokenizer", "seq_len", "splits", "tokenizer.vocab_size", "splits.train.num_samples",
                                  "splits.train.shards.0.path"])
def test_a_manifest_without_a_key_is_named(prepared, tmp_path, drop):
    from common.errors import InputFileError
    from data_pipeline.shards import read_manifest

    d = tmp_path / "data"
    shutil.copytree(prepared, d)
    m = json.loads((d / "manifest.json").read_text())
    *path, last = drop.split(".")
    obj = m
    for k in path:
        obj = obj[int(k)] if k.isdigit() else obj[k]
    del obj[last]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(InputFileError, match=f"not a complete setdlm-token-shards manifest .*{last}"):
        read_manifest(str(d))


def test_inspect_lists_a_shard_with_ids_past_the_vocabulary(prepared, tmp_path):
    from test_fault_matrix import Ctx, token_id_past_vocab

    d = tmp_path / "data"
    shutil.copytree(prepared, d)
    token_id_past_vocab(Ctx(tmp=tmp_path, recipe=None, run=None, data=d, ev=None, results=None, hf=None, out_dir=None, out_file=None))
    r = setdlm("data", "inspect", d, "--verify")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "BAD" in r.stdout and "token id 65535 of sample 1 is outside the vocabulary" in r.stdout, r.stdout


@pytest.mark.parametrize("file,drop", [("run.json", "task"), ("run.json", "spec"), ("units.json", "keys")])
def test_merge_names_a_missing_key(tmp_path, file, drop):
    from eval.errors import EvalError
    from eval.merge import merge

    out = tmp_path / "ev"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"format": "setdlm-eval", "version": 1, "task": "likelihood", "spec": {}}))
    (out / "units.json").write_text(json.dumps({"n_units": 1, "n_examples": 1, "keys": [["a"]]}))
    data = json.loads((out / file).read_text())
    del data[drop]
    (out / file).write_text(json.dumps(data))
    with pytest.raises(EvalError, match=f"{file}: not a setdlm evaluation file \\(needs `{drop}`"):
        merge(out)


def test_merge_names_a_truncated_run_json(tmp_path):
    from eval.errors import EvalError
    from eval.merge import merge

    (tmp_path / "run.json").write_text('{"task": "likel')
    with pytest.raises(EvalError, match="run.json: unreadable or truncated"):
        merge(tmp_path)


# -- links ----------------------------------------------------------------------------------------------
def test_links_that_loop_or_leave_the_run_are_refused(tmp_path):
    from pretrain.checkpoint import rundir
    from pretrain.safe_load import CheckpointError

    run = tmp_path / "run"
    root = run / "checkpoints"
    make_checkpoint(root, 2)
    (root / "latest").write_text("step_00000002")
    assert rundir.resolve_checkpoint(run) == root / "step_00000002"

    other = make_checkpoint(tmp_path / "other" / "checkpoints", 4)
    (root / "step_00000004").symlink_to(other)
    (root / "latest").write_text("step_00000004")
    for call in (lambda: rundir.check_run_dir(run), lambda: rundir.resolve_checkpoint(run),
                 lambda: rundir.latest_checkpoint(root)):
        with pytest.raises(CheckpointError, match="step_00000004: a symbolic link to .* outside the run directory"):
            call()
    assert [p.name for p in rundir.complete_checkpoints(root)] == ["step_00000002"]  # never pruned nor resumed

    (root / "step_00000004").unlink()
    (root / "latest").unlink()
    (root / "latest").symlink_to(tmp_path / "other" / "latest")
    with pytest.raises(CheckpointError, match="latest: a symbolic link"):
        rundir.check_run_dir(run)

    (root / "latest").unlink()
    shutil.move(root, run / "moved")
    root.symlink_to(root)
    with pytest.raises(CheckpointError, match="checkpoints: a symbolic link that loops"):
        rundir.resolve_checkpoint(run)


def test_links_inside_the_run_are_fine(tmp_path):
    from pretrain.checkpoint import rundir

    run = tmp_path / "run"
    make_checkpoint(run / "store", 2)
    (run / "store" / "latest").write_text("step_00000002")
    (run / "checkpoints").symlink_to(run / "store")
    rundir.check_run_dir(run)
    assert rundir.resolve_checkpoint(run).name == "step_00000002"


# -- token ids and bad shards ---------------------------------------------------------------------------
def _source(prepared, tmp_path, token: int | None = None, verify: bool = False):
    from data_pipeline.shards import ShardSource, read_manifest
    from test_fault_matrix import Ctx, token_id_past_vocab

    d = tmp_path / "data"
    shutil.copytree(prepared, d)
    if token is not None:
        token_id_past_vocab(Ctx(tmp=tmp_path, recipe=None, run=None, data=d, ev=None, results=None, hf=None, out_dir=None, out_file=None),
                            token=token)
    return ShardSource(str(d), read_manifest(str(d)), verify=verify)


@pytest.mark.parametrize("token", [50258, 50303, 65535], ids=["vocab", "last padded row", "uint16 max"])
def test_token_ids_outside_the_vocabulary_are_refused_at_load(prepared, tmp_path, token):
    """Without checksum verification too: an id at or past the tokenizer's vocabulary (50258 with
    GPT-2's MASK) would index past the embedding or silently train a padding row (up to 50303)."""
    from data_pipeline.sources import ShardError

    src = _source(prepared, tmp_path, token)
    with pytest.raises(ShardError, match=f"shard-000000.tar: token id {token} of sample 1 is outside the vocabulary"):
        src.read_unit("train", 0)
    assert src.read_unit("train", 1).max() < 50258  # the other shards read as before


def test_every_shard_bad_with_skip_bad_shards_is_one_clear_error(prepared, tmp_path):
    from data_pipeline.config import DataConfig
    from data_pipeline.loader import TokenLoader
    from data_pipeline.sources import ShardError

    src = _source(prepared, tmp_path)
    cfg = DataConfig(source=str(tmp_path / "data"), seq_len=32, skip_bad_shards=True)
    for f in (tmp_path / "data" / "train").glob("*.tar"):
        f.write_bytes(b"garbage")
    with pytest.raises(ShardError, match="every shard of the train split .* is bad"):
        next(iter(TokenLoader(src, cfg, split="train", micro_batch=4, dp_rank=0, dp_size=1, seed=0)))


def test_some_shards_bad_with_skip_bad_shards_still_reads(prepared, tmp_path):
    from data_pipeline.config import DataConfig
    from data_pipeline.loader import TokenLoader

    src = _source(prepared, tmp_path)
    cfg = DataConfig(source=str(tmp_path / "data"), seq_len=32, skip_bad_shards=True, shuffle=False)
    shards = sorted((tmp_path / "data" / "train").glob("*.tar"))
    shards[0].write_bytes(b"garbage")
    batches = [b for _, b in zip(range(40), TokenLoader(src, cfg, split="train", micro_batch=4, dp_rank=0, dp_size=1,
                                                         seed=0))]
    assert sum(len(b["input_ids"]) for b in batches) == 40 * 4 - 64  # the 64 samples of the bad shard left out


# -- code shipped with a tokenizer ----------------------------------------------------------------------
@pytest.fixture
def remote_code_dir(tmp_path):
    d = tmp_path / "downloaded"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Planted",
                                                         "auto_map": {"AutoTokenizer": ["planted.Planted", None]}}))
    (d / "config.json").write_text(json.dumps({"model_type": "planted", "auto_map": {"AutoModel": "planted.Model"}}))
    (d / "planted.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('code ran')\n")
    return d


def test_a_tokenizer_with_remote_code_is_refused_with_our_advice(remote_code_dir, tmp_path):
    from data_pipeline.tokenizers import TokenizerError, load_tokenizer

    with pytest.raises(TokenizerError) as e:
        load_tokenizer(str(remote_code_dir))
    msg = str(e.value)
    assert "never runs code from a downloaded model or checkpoint" in msg and "tokenizer.json" in msg, msg
    assert "trust_remote_code" not in msg and not (tmp_path / "ran").exists()
    r = setdlm("data", "prepare", "--input", "builtin:pydoc_topics", "--out", tmp_path / "out", "--tokenizer",
               remote_code_dir, "--max-docs", "2", "--num-proc", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "trust_remote_code" not in r.stderr, r.stderr
    assert "never runs code" in r.stderr and not (tmp_path / "ran").exists()


def test_a_featurizer_with_remote_code_is_refused_with_our_advice(remote_code_dir, tmp_path):
    from transformers import AutoModel

    from eval.errors import EvalError
    from eval.featurize import load_hf

    with pytest.raises(EvalError) as e:
        load_hf(str(remote_code_dir), AutoModel, "cpu", "--featurizer", "use minilm")
    assert "never runs code" in str(e.value) and "trust_remote_code" not in str(e.value), e.value
    assert not (tmp_path / "ran").exists()


def test_the_repository_never_advises_trust_remote_code_for_a_download():
    """Only the export's own documentation (our code, shipped by us) mentions trust_remote_code."""
    hits = [p.relative_to(REPO).as_posix() for pkg in ("common", "data_pipeline", "model", "pretrain", "eval", "launch")
            for p in (REPO / pkg).rglob("*.py") if "trust_remote_code=True" in p.read_text()]
    assert set(hits) <= {"model/convert/card.py", "model/convert/hf_code/modeling_setdlm.py", "pretrain/convert/export.py",
                         "pretrain/convert/adapter.py"}, hits
