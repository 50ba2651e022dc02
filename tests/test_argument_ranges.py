"""Arguments are validated like recipe keys: `data prepare`'s numbers, `--dry-run`'s world size (a
range, and a plan whose time does not grow with it), and the numbers read from the environment."""

from __future__ import annotations

import time

import pytest

from helpers import write_recipe


def one_line(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("flag,value,valid", [
    ("--samples-per-shard", "-1", ">= 1"), ("--samples-per-shard", "0", ">= 1"), ("--max-docs", "-1", ">= 1"),
    ("--max-docs", "0", ">= 1"), ("--val-docs", "-3", ">= 0"), ("--num-proc", "0", ">= 1"),
    ("--docs-per-task", "0", ">= 1"), ("--seq-len", "1", ">= 2"), ("--marker-offset", "-1", ">= 0"),
])
def test_prepare_refuses_a_number_out_of_range(tmp_path, capsys, flag, value, valid):
    from launch.cli import main

    out = tmp_path / "out"
    code = main(["data", "prepare", "--input", "builtin:pydoc_topics", "--out", str(out), flag, value])
    one_line(capsys, code, f"{flag}: must be an integer {valid}, got {value}")
    assert not out.exists()


def test_prepare_keeps_the_last_example_with_max_docs(tmp_path, capsys):
    """--max-docs N keeps the first N documents (a negative N used to drop the last one silently)."""
    from launch.cli import main

    out = tmp_path / "out"
    assert main(["data", "prepare", "--input", "builtin:pydoc_topics", "--out", str(out), "--seq-len", "32",
                 "--max-docs", "3", "--num-proc", "1"]) == 0
    assert "(3 documents)" in capsys.readouterr().out


@pytest.fixture
def recipe(tmp_path):
    return write_recipe(tmp_path / "r.yaml")


@pytest.mark.parametrize("world", ["0", "-3", str((1 << 20) + 1), "1000000000000"])
def test_dry_run_refuses_a_world_size_out_of_range_at_once(recipe, capsys, world):
    from launch.cli import main

    t = time.perf_counter()
    one_line(capsys, main(["pretrain", "--config", str(recipe), "--dry-run", "--world-size", world]),
             f"--world-size: must be an integer in [1, 1048576], got {world}")
    assert time.perf_counter() - t < 30


def test_world_size_without_dry_run_is_refused(recipe, tmp_path, capsys):
    from launch.cli import main

    one_line(capsys, main(["pretrain", "--config", str(recipe), "--world-size", "2", "--out", str(tmp_path / "r")]),
             "--world-size: only with --dry-run")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name,value", [("SETDLM_GPU_MEMORY_GIB", "-1"), ("SETDLM_GPU_MEMORY_GIB", "0"),
                                        ("SETDLM_GPU_MEMORY_GIB", "lots"), ("SETDLM_GPU_MEMORY_GIB", "nan"),
                                        ("SETDLM_GPU_MEMORY_GIB", "inf"), ("SETDLM_GPUS_PER_NODE", "0"),
                                        ("SETDLM_GPUS_PER_NODE", "8.5"), ("WORLD_SIZE", "0"), ("WORLD_SIZE", "two")])
def test_dry_run_refuses_a_bad_environment_number(recipe, capsys, monkeypatch, name, value):
    from launch.cli import main

    monkeypatch.setenv(name, value)
    one_line(capsys, main(["pretrain", "--config", str(recipe), "--dry-run"]), f"environment variable {name}={value!r}")


def test_dry_run_uses_a_valid_environment_number(recipe, capsys, monkeypatch):
    from launch.cli import main

    monkeypatch.setenv("SETDLM_GPU_MEMORY_GIB", "40")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["pretrain", "--config", str(recipe), "--dry-run", "train.micro_batch=1"]) == 0
    out = capsys.readouterr().out
    assert "within 90% of 40 GiB per GPU" in out and "layout: world 4 = TP 1 x PP 1 x DP 4" in out


def test_groups_are_computed_as_megatron_enumerates_them():
    from pretrain.plan import groups_of, rank_groups

    for tp, pp, dp in ((2, 4, 3), (1, 1, 5), (8, 2, 2), (3, 1, 1), (1, 3, 2)):
        g = rank_groups(tp, pp, dp)
        for r in range(tp * pp * dp):
            mine = groups_of(r, tp, pp, dp)
            for k in ("tp", "pp", "dp"):
                assert list(mine[k]) == next(x for x in g[k] if r in x), (tp, pp, dp, r, k)


def test_plan_time_does_not_grow_with_the_world_size(tmp_path):
    """64 GPUs and 1,048,576 GPUs (the largest world a dry run takes) plan in about the same time:
    the groups of the printed ranks are computed, never every rank's."""
    from pretrain.config import load_config
    from pretrain.plan import MAX_WORLD, format_plan, plan

    def timed(world: int) -> tuple[float, str]:
        cfg = load_config("configs/qwen3-1.7b-setdlm.yaml", ["parallel.tp=8", "parallel.pp=4", "train.micro_batch=1",
                                                             f"train.global_batch={world // 32}"])
        t = time.perf_counter()
        text = format_plan(cfg, plan(cfg, world))
        return time.perf_counter() - t, text

    timed(64)  # warm-up: imports, the tokenizer, the meta-device stage shapes
    small, _ = timed(64)
    big, text = timed(MAX_WORLD)
    assert f"layout: world {MAX_WORLD} = TP 8 x PP 4 x DP 32768" in text
    assert f"... {MAX_WORLD - 128} more ranks" in text and "DP groups of 32768" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["9"])
    assert row.split()[3:7] == ["8..15", "9..786441", "step", "262144"] and "1..262137 step 8" in row, row
    assert big < 5 * small + 1.0, (small, big)
