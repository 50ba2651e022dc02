"""A full disk during every kind of write, on a real tmpfs (tests/mounts.py; skipped without root).

Each write (a checkpoint save, a metrics row, an evaluation record, a prepared shard, a Hugging Face
export) meets ENOSPC for real (torch's zip writer then raises RuntimeError, safetensors its own
error): the command exits with status 2 and one line naming the path and the space, its partial
output is removed, the last good output is kept, and a rerun with space continues.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from helpers import read_metrics, write_recipe
from mounts import fill

STEPS = {"max_steps": 8, "save_every": 2, "eval_every": 0, "log_every": 1, "ema": 0.5, "sample_at_end": False,
         "keep_last": 2}


def error_line(capsys, code: int) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def temps(d: Path) -> list[str]:
    return sorted(p.name for p in Path(d).rglob(".*") if "tmp" in p.name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_parallel):
    from launch.cli import main

    base = tmp_path_factory.mktemp("storage")
    recipe = write_recipe(base / "r.yaml", train={**STEPS, "max_steps": 2})
    assert main(["pretrain", "--config", str(recipe), "--out", str(base / "runs")]) == 0
    return base / "runs" / "tiny"


def test_full_disk_during_a_save_then_the_requeued_job_then_space(tmp_path, mounts, model_parallel, capsys):
    """The run's disk holds the tokenizer and one checkpoint, not two: the step-4 save fails (torch's
    RuntimeError from a short write), is removed, step 2 stays; the requeued job says so before any
    work; with space the same command resumes from step 2 and ends with one metrics row per step."""
    from launch.cli import main

    disk = mounts.tmpfs("disk", "36m")
    recipe = write_recipe(tmp_path / "r.yaml", train=STEPS)
    cmd = ["pretrain", "--config", str(recipe), "--out", str(disk)]
    run = disk / "tiny"
    root = run / "checkpoints"

    line = error_line(capsys, main(cmd))
    assert "saving checkpoint step 4 failed" in line and "No space left on device" in line, line
    assert "a checkpoint needs about" in line and "last good checkpoint (step_00000002) is kept" in line, line
    assert str(root) in line
    assert (root / "latest").read_text() == "step_00000002" and (root / "step_00000002" / "COMPLETE").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"] and not temps(run)
    rows = (run / "metrics.jsonl").read_text()
    assert all(json.loads(r) for r in rows.splitlines())

    line = error_line(capsys, main(cmd))  # requeued on the still-full disk: before any work
    assert "No space left on device for the next checkpoint" in line and "nothing was trained" in line, line
    assert "the size of step_00000002" in line, line
    assert (run / "metrics.jsonl").read_text() == rows
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]

    mounts.resize(disk, "90m")
    assert main(cmd) == 0, capsys.readouterr().err[-3000:]
    assert (root / "latest").read_text() == "step_00000008"
    assert sorted(read_metrics(run)) == list(range(1, 9))
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 8  # each step once
    assert not temps(run)


def test_a_metrics_row_on_a_full_disk(trained, tmp_path, mounts, capsys):
    """metrics.jsonl on a full file system: the row is cut off again, one line names the file."""
    from launch.cli import main

    run = tmp_path / "runs" / "tiny"
    shutil.copytree(trained, run)
    full = mounts.full("full")
    (full / "metrics.jsonl").write_text("")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(full / "metrics.jsonl")
    recipe = write_recipe(tmp_path / "r.yaml", train=STEPS)
    line = error_line(capsys, main(["pretrain", "--config", str(recipe), "--out", str(run.parent), "train.max_steps=4"]))
    assert f"{run / 'metrics.jsonl'}: No space left on device" in line and "the write needs about" in line, line
    assert (full / "metrics.jsonl").read_text() == ""  # no half row
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"


def test_append_file_keeps_whole_lines(tmp_path, mounts):
    from common.errors import StorageError
    from common.io import AppendFile

    d = mounts.tmpfs("small", "64k")
    line = json.dumps({"x": "y" * 300}) + "\n"
    with AppendFile(d / "log.jsonl") as f, pytest.raises(StorageError, match="log.jsonl: No space left on device"):
        for _ in range(10_000):
            f.append(line)
    text = (d / "log.jsonl").read_text()
    assert text and text.count("\n") * len(line) == len(text)


def test_atomic_write_on_a_full_disk_leaves_the_old_file(tmp_path, mounts):
    from common.errors import StorageError
    from common.io import atomic_write_bytes

    d = mounts.tmpfs("small", "64k")
    atomic_write_bytes(d / "f.bin", b"old")
    with pytest.raises(StorageError, match=r"f.bin: No space left on device .*needs about 1.0 MiB"):
        atomic_write_bytes(d / "f.bin", b"\0" * (1 << 20))
    assert (d / "f.bin").read_bytes() == b"old" and sorted(p.name for p in d.iterdir()) == ["f.bin"]


def test_eval_records_on_a_full_disk(trained, tmp_path, mounts, capsys):
    from launch.cli import main

    out = tmp_path / "ev"
    out.mkdir()
    full = mounts.full("full")
    (full / "records.rank00000.jsonl").write_text("")
    (out / "records.rank00000.jsonl").symlink_to(full / "records.rank00000.jsonl")
    line = error_line(capsys, main(["eval", "likelihood", "--checkpoint", str(trained), "--out", str(out),
                                    "--max-batches", "1"]))
    assert f"{out / 'records.rank00000.jsonl'}: No space left on device" in line, line
    assert (full / "records.rank00000.jsonl").read_text() == "" and not (out / "metrics.json").exists()


@pytest.mark.slow
def test_prepare_on_a_full_disk_keeps_its_shards_and_resumes(tmp_path, mounts, capsys):
    """The disk fills after a few shards: the shards before are kept with their progress, and the
    same command, with space, resumes and ends with the shards of a run that never failed."""
    from launch.cli import main

    args = ["data", "prepare", "--input", "builtin:pydoc_topics", "--seq-len", "32", "--samples-per-shard", "32",
            "--max-docs", "12", "--num-proc", "1"]
    ref = tmp_path / "ref"
    assert main([*args, "--out", str(ref)]) == 0
    from common.storage import tree_bytes

    shards = sorted((ref / "train").glob("*.tar"))
    assert len(shards) > 6
    disk = mounts.tmpfs("disk", "16m")
    keep_free = tree_bytes(ref / "tokenizer") + 3 * shards[0].stat().st_size + 64 * 1024
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(disk).free - keep_free))
    out = disk / "data"
    line = error_line(capsys, main([*args, "--out", str(out)]))
    assert "No space left on device" in line and str(out) in line, line
    partial = json.loads((out / "manifest.partial.json").read_text())
    kept = partial["splits"]["train"]["shards"]
    assert 0 < len(kept) < len(shards)
    for e in kept:
        assert (out / e["path"]).read_bytes() == (ref / e["path"]).read_bytes()
    assert not temps(out) and not (out / "manifest.json").exists()

    (disk / "filler").unlink()
    assert main([*args, "--out", str(out)]) == 0
    got, want = (json.loads((d / "manifest.json").read_text())["splits"] for d in (out, ref))
    assert [[s["sha256"] for s in got[k]["shards"]] for k in got] == [[s["sha256"] for s in want[k]["shards"]]
                                                                   for k in want]
    assert not (out / "manifest.partial.json").exists()


def test_hf_export_on_a_full_disk_keeps_the_last_export(trained, tmp_path, mounts, capsys):
    from launch.cli import main
    from test_fault_matrix import digest

    disk = mounts.tmpfs("disk", "16m")
    out = disk / "hf"
    assert main(["convert", "to-hf", "--checkpoint", str(trained), "--out", str(out)]) == 0
    before = digest(out)
    fill(disk)
    line = error_line(capsys, main(["convert", "to-hf", "--checkpoint", str(trained), "--out", str(out), "--no-ema",
                                    "--overwrite"]))
    assert "No space left on device" in line and "the write needs about" in line, line
    assert "partial output directory was removed" in line and "is kept as it was" in line, line
    assert digest(out) == before
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "hf"]


def test_export_at_end_on_a_full_disk_is_an_error(trained, tmp_path, monkeypatch):
    """train.export_hf: a full disk is not a note at the end of the log but an error status."""
    from common.errors import StorageError
    from pretrain.convert import export as hf_export

    run = tmp_path / "run"
    shutil.copytree(trained, run)

    def full(tensors, out_dir, limit):
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "model.safetensors"))

    monkeypatch.setattr(hf_export, "write_weights", full)
    with pytest.raises(StorageError, match="train.export_hf: .*No space left on device.*--overwrite"):
        hf_export.export_at_end(run)
    assert not (run / "hf").exists() and not temps(run)
