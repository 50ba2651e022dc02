"""The family study runs at HEAD (a smoke run: tiny budget, all five families, two seeds) and its error
bars combine seeds and Monte-Carlo draws as benchmarks/study_stats.py says."""

import json
import math
import subprocess
import sys

import pytest

from helpers import REPO, cli_env

sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package
from benchmarks import study_families  # noqa: E402
from benchmarks.study_stats import family_summary, ordering  # noqa: E402


def test_family_summary_combines_seed_spread_and_monte_carlo_error():
    f = family_summary([4.0, 4.2, 4.4], [0.03, 0.04, 0.0])
    assert f["mean"] == pytest.approx(4.2) and f["seed_sd"] == pytest.approx(0.2)
    assert f["mc_se"] == pytest.approx(0.05 / 3)
    assert f["se"] == pytest.approx(math.sqrt(0.04 / 3 + (0.05 / 3) ** 2))
    one = family_summary([5.0], [0.1])
    assert one["seed_sd"] == 0.0 and one["se"] == pytest.approx(0.1)


def test_orderings_are_held_only_beyond_two_combined_errors():
    fams = {"A": {"mean": 4.0, "se": 0.03}, "B": {"mean": 4.12, "se": 0.04}, "C": {"mean": 4.05, "se": 0.04}}
    assert ordering("A", "B", fams)["verdict"] == "held"  # 0.12 > 2 x 0.05
    assert ordering("B", "A", fams)["verdict"] == "reversed"
    o = ordering("A", "C", fams)  # 0.05 < 2 x 0.05
    assert o["verdict"] == "not resolved" and o["sigma"] == pytest.approx(0.05) and o["z"] == pytest.approx(1.0)


@pytest.mark.slow
def test_the_study_runs_end_to_end_and_records_how_to_regenerate_it(tmp_path, model_parallel):
    out, doc = tmp_path / "study", tmp_path / "doc" / "study.md"
    argv = ["--seeds", "2", "--steps", "2", "--hidden", "16", "--orders", "2", "--batches", "1", "--jobs", "1",
            "--threads", "1", "--out", str(out), "--doc", str(doc)]
    assert study_families.main(argv) == 0
    data = json.loads(doc.with_suffix(".json").read_text())
    names = [n for n, _ in study_families.FAMILIES]
    assert list(data["families"]) == names and len(data["per_seed"]) == 2 * len(names)
    assert {r["seed"] for r in data["per_seed"]} == {1234, 1235}
    for name, f in data["families"].items():
        vals = [r["nll"] for r in data["per_seed"] if r["family"] == name]
        assert f["mean"] == pytest.approx(sum(vals) / 2) and f["seed_sd"] == pytest.approx(abs(vals[0] - vals[1]) / math.sqrt(2))
        assert f["se"] >= f["seed_sd"] / math.sqrt(2) and all(math.isfinite(v) for v in vals)
    assert all(r["rows"] == 16 for r in data["per_seed"])  # --batches 1: one batch of 16 validation rows
    assert [o["claim"] for o in data["orderings"]] == [f"{a} < {b}" for a, b in study_families.ORDERINGS]
    assert all(o["verdict"] in ("held", "reversed", "not resolved") for o in data["orderings"])
    assert "forced_mask" in data["families"]["BD3-LM B=4"]
    assert "speed" not in data  # speed against quality: benchmarks/paper_miniature.py
    text = doc.read_text()
    assert f"`{data['command']}`" in text and data["commit"] in text
    for opt in ("--seeds 2", "--batches 1", "--jobs 1", "--orders 2"):
        assert opt in data["command"]
    assert "docs/paper_miniature.md" in text and not doc.with_suffix(".png").exists()

    # The recorded command's path: runs trained elsewhere (--jobs > 1 trains in subprocesses), evaluated
    # in a process that never set up megatron's parallel state (the BD3-LM forced-mask step crashed there).
    again = tmp_path / "again.md"
    argv[argv.index("--jobs") + 1], argv[-1] = "2", str(again)
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "study_families.py"), *argv], cwd=REPO, env=cli_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(again.with_suffix(".json").read_text())["families"] == data["families"]
