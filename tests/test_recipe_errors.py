"""Typed recipes: every bad value stops `setdlm pretrain` before any work with one line naming the field;
`setdlm pretrain --describe` prints every field; overrides may come before or after flags."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from helpers import REPO, cli_env, write_recipe
from launch.cli import main as cli_main
from pretrain.config import _CLASSES, load_config

BAD = [
    (["train.max_steps=2.5"], "train.max_steps: must be an integer >= 1, got 2.5"),
    (["train.min_lr=1e-2", "train.lr=1e-3"], "train.min_lr: 0.01 must be <= train.lr=0.001"),
    (["train.grad_clip=-1"], "train.grad_clip: must be >= 0.0, got -1"),
    (["train.save_every=0"], "train.save_every: must be >= 1, got 0"),
    (["train.log_every=0"], "train.log_every: must be >= 1, got 0"),
    (["train.lr=0"], "train.lr: must be > 0.0, got 0"),
    (["train.eval_batches=-1"], "train.eval_batches: must be >= 0, got -1"),
    (["data.shuffle=maybe"], "data.shuffle: must be true or false, got 'maybe'"),
    (["logging.progress=2"], "logging.progress: must be true or false, got 2"),
    (["logging.wandb=sometimes"], "logging.wandb: must be one of auto, online, offline, disabled, got 'sometimes'"),
    (["train.lr_schedule=linear"], "train.lr_schedule: must be one of constant, cosine, got 'linear'"),
    (["parallel.zero_stage=4"], "parallel.zero_stage: must be one of 0, 1, 2, 3, got 4"),
    (["model.dropout=.nan"], "model.dropout: must be a finite number"),
    (["model.dropout=nan"], "model.dropout: must be a number in [0.0, 1.0), got 'nan'"),
    (["run.name=a/b"], "run.name: must be a single directory name"),
    (["train.max_step=3"], "train.max_step: unknown key; valid keys: max_steps,"),
    (["trian.max_steps=3"], "trian: unknown config section"),
    (["objective.set_size=8", "objective.s_max=4"], "objective.s_max: S_max=4 must be >= D=8"),  # cross-field, as before
    (["data.seq_len=128"], "data.seq_len: 128 exceeds model.max_seq_len=64"),
]


def _run_cli(capsys, argv):
    code = cli_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0][-1] for b in BAD])
def test_bad_value_is_one_line_naming_the_field_and_nothing_is_saved(tmp_path, capsys, overrides, message):
    recipe = write_recipe(tmp_path / "r.yaml")
    code, out, err = _run_cli(capsys, ["pretrain", "--config", str(recipe), "--out", str(tmp_path / "runs"), *overrides])
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("setdlm pretrain: error: "), err
    assert message in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_bad_types_in_the_yaml_file(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", data={"tokenizer": ["gpt2"]})
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(recipe)])
    assert code == 2 and "data.tokenizer: must be a string, got ['gpt2']" in err, err
    recipe = write_recipe(tmp_path / "r.yaml", train={"max_steps": "ten"})
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(recipe)])
    assert code == 2 and "train.max_steps: must be an integer >= 1, got 'ten'" in err, err
    recipe = write_recipe(tmp_path / "r.yaml")
    recipe.write_text(recipe.read_text() + "parallel: fast\n")
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(recipe)])
    assert code == 2 and "parallel: must be a mapping of keys" in err, err


def test_numeric_run_name_is_a_name(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml")
    cfg = load_config(recipe, ["run.name=12345", f"run.out_dir={tmp_path}"])
    assert cfg.run.name == "12345" and cfg.run_dir == tmp_path / "12345"
    (tmp_path / "n.yaml").write_text(recipe.read_text().replace("name: tiny", "name: 12345"))
    assert load_config(tmp_path / "n.yaml").run.name == "12345"
    code, out, err = _run_cli(capsys, ["pretrain", "--config", str(recipe), "--dry-run", "--name", "12345"])
    assert code == 0, err
    # a string field takes the text as written, so a prompt with YAML syntax in it stays a string
    assert load_config(recipe, ["train.sample_prompt=Q: why? A:"]).train.sample_prompt == "Q: why? A:"


def test_empty_or_partial_recipe_names_the_missing_sections(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(empty), "--out", str(tmp_path / "runs")])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not set the sections model, objective, data, train" in err, err
    partial = tmp_path / "partial.yaml"
    partial.write_text("model: {preset: tiny}\nobjective: {name: ar}\n")
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(partial)])
    assert code == 2 and "does not set the sections data, train" in err, err
    assert not (tmp_path / "runs").exists()


def test_yaml_syntax_error_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\ntrain:\n  max_steps: [3\n  lr: 1e-3\n")
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(bad)])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{bad}:5:" in err and "YAML syntax error" in err, err
    (tmp_path / "latin1.yaml").write_bytes(b"run:\n  name: caf\xe9\n")
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(tmp_path / "latin1.yaml")])
    assert code == 2 and "is not UTF-8 text" in err, err


def test_flags_and_overrides_in_any_order(tmp_path, capsys, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml")
    seen = {}
    monkeypatch.setattr("pretrain.plan.print_plan", lambda cfg, world_size, **kw: seen.setdefault("cfg", cfg))
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(recipe), "train.max_steps=3", "--name", "late",
                                     "train.lr=1e-3", "--dry-run", "model.dropout=0.25", "--out", str(tmp_path)])
    assert code == 0, err
    cfg = seen["cfg"]
    assert (cfg.train.max_steps, cfg.train.lr, cfg.model.dropout, cfg.run.name) == (3, 1e-3, 0.25, "late")
    code, _, err = _run_cli(capsys, ["pretrain", "--config", str(recipe), "--dry-run", "--nmae", "x"])
    assert code == 2 and "unrecognized arguments: --nmae" in err and len(err.strip().splitlines()) == 1, err


def test_convert_takes_overrides_after_flags():
    from pretrain.convert.cli import build_parser

    args = build_parser().parse_args(["from-hf", "--model", "m", "a.b=1", "--out", "o", "c.d=2", "--overwrite"])
    assert args.overrides == ["a.b=1", "c.d=2"] and args.out == "o" and args.overwrite


def test_describe_prints_every_field_with_its_description(capsys):
    code, out, _ = _run_cli(capsys, ["pretrain", "--describe"])
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for name, cls in _CLASSES.items():
        for f in dataclasses.fields(cls):
            fi = cls.__pydantic_fields__[f.name]
            assert fi.description, f"{name}.{f.name} has no description"
            line = lines[f"{name}.{f.name}"]
            assert fi.description in line, line
    assert "int >= 1" in lines["train.max_steps"] and "constant | cosine" in lines["train.lr_schedule"]
    code, out, _ = _run_cli(capsys, ["pretrain", "--describe", "objective.k"])
    assert code == 0 and out.strip().startswith("objective:") and "objective.k" in out and "train." not in out
    code, out, _ = _run_cli(capsys, ["pretrain", "--schema"])
    assert code == 0 and '"max_steps"' in out


def test_subprocess_error_has_no_traceback_and_debug_keeps_it(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    cmd = [sys.executable, "-m", "launch.cli", "pretrain", "--config", str(recipe), "--out", str(tmp_path / "runs"),
           "train.max_steps=2.5"]
    r = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["setdlm pretrain: error: train.max_steps: must be an integer >= 1, got 2.5"]
    assert "Traceback" not in r.stdout + r.stderr and not (tmp_path / "runs").exists()
    r = subprocess.run(cmd, cwd=REPO, env={**cli_env(), "SETDLM_DEBUG": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError: train.max_steps" in r.stderr


def test_other_subcommands_use_the_same_one_line_errors(capsys):
    code, _, err = _run_cli(capsys, ["data", "prepare", "--bogus"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("setdlm data prepare: error:"), err
    code, _, err = _run_cli(capsys, ["convert", "from-hf", "--model", "/no/such/dir", "--out", "/tmp/none"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "/no/such/dir" in err, err
