"""The evaluation matrix template as a real Slurm array job (one-node cluster started by the test).

Two cells (array tasks), each split over two srun tasks that coordinate through the output directory;
rank 0 of each cell merges. Skips when not root or without the Debian packages slurm-wlm/munge.
"""
from __future__ import annotations

import json
import sys
import time

import pytest

from helpers import read_metrics, write_recipe
from tests.cluster.jobs import REPO, job_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_eval_matrix_array_job(slurm, tmp_path, model_parallel):
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    recipe = write_recipe(tmp_path / "r.yaml", train={"max_steps": 2, "eval_every": 2, "save_every": 2,
                                                      "eval_batches": 2, "log_every": 2})
    Trainer(load_config(recipe, [f"run.out_dir={tmp_path}"])).train()
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(f"""
out: {tmp_path}/results
checkpoints: {{tiny: {tmp_path}/tiny}}
tasks:
  likelihood:
    settings: {{match: --match-training, one-batch: --max-batches 1}}
""")
    extra = ["--nodes=1", "--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
             "--array=0-1", f"--output={tmp_path}/%x-%A_%a.out"]
    env = job_env(MATRIX=str(matrix), EVAL_CMD=f"{sys.executable} -m launch.cli eval")
    slurm.sbatch([str(REPO / "eval" / "templates" / "eval_matrix.sbatch")], extra=extra, env=env, cwd=REPO)
    cells = [tmp_path / "results" / "tiny" / "likelihood" / s for s in ("match", "one-batch")]
    ranks = ["records.rank00000.jsonl", "records.rank00001.jsonl"]
    deadline = time.monotonic() + 400
    # rank 0 merges once every unit has records; a rank that owns no unit (the one-batch cell) may open its
    # records file after that on a loaded machine, so the wait is for both ranks' files too
    while not all((c / "metrics.json").is_file() and all((c / r).is_file() for r in ranks) for c in cells):
        if time.monotonic() > deadline:
            logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.out"))
            pytest.fail("array job did not finish:\n" + logs + slurm.logs_tail())
        time.sleep(1)
    match = json.loads((cells[0] / "metrics.json").read_text())
    assert match["metrics"]["nll"] == read_metrics(tmp_path / "tiny")[2]["val/nll"]
    assert match["created"]["world"] == 2 and match["created"]["launcher"] == "slurm"
    for c in cells:
        assert sorted(p.name for p in c.glob("records.rank*.jsonl")) == ranks
    assert json.loads((cells[1] / "metrics.json").read_text())["metrics"]["sequences"] == 4
