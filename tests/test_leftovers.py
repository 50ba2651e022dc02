"""Nothing left behind: what killed runs leave is removed at the next start (interrupted saves and
prunes, temporary files of checkpoints, `latest`, meta.json, config.yaml, eval records and prepared
shards), without touching the temporary file of a writer that is still running; and pruning
finishes a step a kill left half pruned."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.io import HOST
from helpers import write_recipe
from test_file_faults import make_checkpoint



def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def temp(d: Path, name: str, pid: int | None = None, host: str = HOST, age_s: float = 0.0) -> Path:
    """A temporary file as common/io.py names one (`pid=None`: tempfile's own form, older setdlm)."""
    f = d / (f".{name}.{host}.{pid}.abcd1234.tmp" if pid is not None else f".{name}.k2j4h5g6.tmp")
    f.write_text("partial")
    if age_s:
        t = time.time() - age_s
        os.utime(f, (t, t))
    return f


def test_atomic_writes_name_their_writer():
    """The temporary name holds this host and pid (what remove_temps tells live writers by)."""
    from common import io

    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(Path(src).name)
        real(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(io.os, "replace", spy)
        io.atomic_write_text(Path("/tmp") / f"fio-probe-{os.getpid()}", "x")
    os.unlink(Path("/tmp") / f"fio-probe-{os.getpid()}")
    assert seen and seen[0].startswith(f".fio-probe-{os.getpid()}.{HOST}.{os.getpid()}.") and io._TEMP.match(seen[0])


def test_remove_temps_keeps_live_writers(tmp_path):
    from common.io import FOREIGN_TEMP_AGE_S, remove_temps

    gone = [temp(tmp_path, "latest", dead_pid()), temp(tmp_path, "examples.jsonl", age_s=2 * FOREIGN_TEMP_AGE_S),
            temp(tmp_path, "metrics.json", 12, host="othernode", age_s=2 * FOREIGN_TEMP_AGE_S)]
    kept = [temp(tmp_path, "summary.md", os.getpid()), temp(tmp_path, "units.json", 12, host="othernode"),
            temp(tmp_path, "run.json")]
    (tmp_path / "records.rank00000.jsonl").write_text("{}\n")
    (tmp_path / ".hidden.tmp").write_text("not ours")
    assert sorted(remove_temps(tmp_path)) == sorted(gone)
    assert all(p.exists() for p in kept) and (tmp_path / ".hidden.tmp").exists()
    remove_temps(tmp_path, all_of_them=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden.tmp", "records.rank00000.jsonl"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_parallel):
    from launch.cli import main

    base = tmp_path_factory.mktemp("leftovers")
    recipe = write_recipe(base / "r.yaml", train={"max_steps": 4, "save_every": 2, "eval_every": 0, "log_every": 2,
                                                  "sample_at_end": False, "keep_last": 3})
    assert main(["pretrain", "--config", str(recipe), "--out", str(base / "runs")]) == 0
    return recipe, base / "runs" / "tiny"


def test_training_start_removes_what_a_killed_run_left(trained, tmp_path, model_parallel):
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    recipe, src = trained
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(src, run)
    root = run / "checkpoints"
    real = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    left = [temp(root, "latest", dead_pid()), temp(root, "latest"), temp(root / "step_00000004", "meta.json", 1),
            temp(run, "config.yaml", dead_pid()), temp(run, "metrics.jsonl", 7, host="othernode")]
    for d in (".tmp-step_00000006", ".tmp-pruned-step_00000002"):
        (root / d).mkdir()
        (root / d / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    Trainer(load_config(recipe, [f"run.out_dir={run.parent}"]))  # start-up, before any work
    assert not any(p.exists() for p in left)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == real


def test_eval_start_removes_dead_writers_temps(tmp_path):
    from eval.shard import Shard
    from eval.units import EvalRun

    out = tmp_path / "ev"
    out.mkdir()
    dead = temp(out, "examples.jsonl", dead_pid())
    live = temp(out, "metrics.json", os.getpid())
    EvalRun(out, "likelihood", {"seed": 0}, Shard(), log=lambda m: None)
    assert not dead.exists() and live.exists() and (out / "run.json").is_file()


def test_prepare_start_removes_dead_writers_temps(tmp_path):
    from launch.cli import main

    out = tmp_path / "data"
    (out / "train").mkdir(parents=True)
    left = [temp(out / "train", "shard-000003.tar", dead_pid()), temp(out, "manifest.partial.json", dead_pid())]
    assert main(["data", "prepare", "--input", "builtin:pydoc_topics", "--out", str(out), "--seq-len", "32",
                 "--max-docs", "4", "--num-proc", "1", "--samples-per-shard", "64"]) == 0
    assert not any(p.exists() for p in left)


# -- pruning --------------------------------------------------------------------------------------------
def test_pruning_finishes_a_half_pruned_step(tmp_path):
    """step_2 lost its COMPLETE marker and a file to a kill mid-prune (older setdlm deleted in place):
    it is no longer complete, and is removed with the next prune; an incomplete step newer than the
    newest complete one (a damaged latest) is left for the fallback to report."""
    from pretrain.checkpoint.save import prune

    root = tmp_path / "checkpoints"
    make_checkpoint(root, 2, complete=False, files=("zero_pp_rank_0_mp_rank_00_optim_states.pt",))
    for s in (4, 6, 8):
        make_checkpoint(root, s)
    make_checkpoint(root, 10, complete=False)
    (root / "latest").write_text("step_00000008")
    prune(root, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000006", "step_00000008", "step_00000010"]


def test_a_prune_cut_by_a_kill_leaves_no_half_step(tmp_path, monkeypatch):
    """A prune renames the step away first: a kill before the deletion leaves .tmp-pruned-step_N
    (removed at the next start), never a half-deleted step_N the fallback could pick."""
    from pretrain.checkpoint import save

    root = tmp_path / "checkpoints"
    for s in (2, 4, 6):
        make_checkpoint(root, s)
    (root / "latest").write_text("step_00000006")

    def killed(path, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(save.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save.prune(root, keep_last=2)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == [".tmp-pruned-step_00000002", "latest", "step_00000004",
                                                      "step_00000006"]
    save.clean_partial(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000006"]
