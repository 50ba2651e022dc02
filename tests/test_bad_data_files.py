"""Bad data is a one-line message naming the file: empty or non-UTF-8 inputs to `setdlm data prepare`
(before any work), and a shard that breaks during training (`setdlm pretrain` stops without a
traceback and saves nothing)."""

from __future__ import annotations

import gzip

import pytest

from helpers import write_recipe


def prepare(*args) -> int:
    from launch.cli import main

    return main(["data", "prepare", *map(str, args)])


def only_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


BAD = {
    "empty.txt": (b"", "empty file (0 bytes)"),
    "blank.txt": (b"\n \n\t\n", "holds no text"),
    "latin1.txt": ("caf\u00e9 cr\u00e8me\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 3)"),
    "latin1.jsonl": ('{"text": "na\u00efve"}\n'.encode("latin-1"), "not UTF-8 text (byte 0xef"),
    "latin1.txt.gz": (gzip.compress("\u00fcber\n".encode("latin-1")), "not UTF-8 text (byte 0xfc at offset 0)"),
}


@pytest.mark.parametrize("name", BAD)
def test_prepare_names_an_empty_or_non_utf8_file(tmp_path, capsys, name):
    data, why = BAD[name]
    d = tmp_path / "corpus"
    d.mkdir()
    (d / ("good" + name[name.index("."):])).write_bytes(
        gzip.compress(b"fine text\n") if name.endswith(".gz") else
        b'{"text": "fine text"}\n' if name.endswith(".jsonl") else b"fine text\n")
    (d / name).write_bytes(data)
    for target in (d / name, d):  # the file itself, and a directory holding it
        assert prepare("--input", target, "--output", tmp_path / "out", "--seq-len", 8) == 2
        line = only_error_line(capsys)
        assert f"{d / name}: {why}" in line, line
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_shard_that_breaks_during_training_is_one_line(tmp_path, capsys, model_parallel):
    from launch.cli import main

    shards = tmp_path / "shards"
    assert prepare("--input", "builtin:pydoc_topics", "--output", shards, "--seq-len", 32, "--val-docs", 10,
                   "--max-docs", 200, "--samples-per-shard", 64) == 0
    train = sorted((shards / "train").glob("shard-*.tar"))
    assert len(train) >= 2
    for f in train:  # every training shard truncated after preparation
        f.write_bytes(f.read_bytes()[:3000])
    recipe = write_recipe(tmp_path / "r.yaml", data={"source": str(shards)},
                          train={"max_steps": 6, "eval_every": 0, "save_every": 3, "sample_at_end": False})
    capsys.readouterr()
    assert main(["pretrain", "--config", str(recipe), "--out", str(tmp_path / "runs")]) == 2
    line = only_error_line(capsys)
    assert "shard-" in line and ".tar" in line and "manifest" in line, line
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists() or not list(
        (tmp_path / "runs" / "tiny" / "checkpoints").glob("step_*"))
