"""eval/templates/paper_matrix.yaml: the paper's tables as one matrix of released checkpoints (every cell a
valid `setdlm eval` command; every row the paper's number and where it is from) and its one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import REPO

TEMPLATE = REPO / "eval" / "templates" / "paper_matrix.yaml"


def test_every_cell_of_the_paper_matrix_is_a_valid_command():
    from eval import api
    from eval.matrix import cell_argv, load_matrix

    cells = load_matrix(str(TEMPLATE))
    tables = {c["table"] for c in cells}
    want = {"GSM8K", "ROCStories infilling", "CNN/DailyMail", "OWT MAUVE", "OWT likelihood", "LM1B likelihood"}
    assert want <= tables
    for c in cells:
        argv = cell_argv(c)
        api.from_argv(argv[0], argv[1:])  # raises on an invalid option
        assert c["release"] and c["paper"]["source"] and c["paper"]["metric"]
    gsm = [c for c in cells if c["task"] == "gsm8k"]
    assert all("--protocol" in c["args"] for c in gsm)
    pareto = [c for c in gsm if c["checkpoint_name"] == "setdlm-gsm8k-smax8"]
    assert len(pareto) == 10 and all(c["args"][c["args"].index("--window") + 1] == "4" for c in pareto)
    assert any(c["paper"]["value"] == 0.664 for c in pareto)


def test_bad_paper_matrices_are_one_line(tmp_path):
    from eval.errors import EvalError
    from eval.matrix import load_matrix

    def bad(text, needle):
        f = tmp_path / "m.yaml"
        f.write_text(text)
        with pytest.raises(EvalError, match=needle):
            load_matrix(str(f))

    ck = "checkpoints: {a: {release: org/a}}\n"
    bad(ck + "rows: [{checkpoint: b, task: gsm8k, paper: {metric: accuracy, source: s}}]\n", "not one of checkpoints")
    bad(ck + "rows: [{checkpoint: a, task: nope, paper: {metric: accuracy, source: s}}]\n", "unknown task")
    bad(ck + "rows: [{checkpoint: a, task: gsm8k}]\n", "paper")
    bad("checkpoints: {a: {hub: org/a}}\nrows: []\n", "release")
    bad(ck + "rows: [{checkpoint: a, task: gsm8k, paper: {metric: m, source: s}}]\ntasks: {gsm8k: {}}\n", "not both")
    assert Path(TEMPLATE).is_file()


def test_an_import_error_names_the_matrix_keys(tmp_path, capsys):
    """`--import` of a release that is a hub id not in the local cache: the one-line error says what to
    edit in the matrix (`release:`), not the flag of `setdlm convert from-reference` (`--model`)."""
    from common.cli import run_command
    from eval.matrix import as_matrix_keys
    from eval.matrix import main as matrix_main

    m = tmp_path / "m.yaml"
    m.write_text(f"out: {tmp_path / 'results'}\nimports: {tmp_path / 'released'}\n"
                 "checkpoints:\n  rel: {release: no-such-org/no-such-release}\n"
                 "tasks: {likelihood: {default: ''}}\n")
    rc = run_command("setdlm eval matrix", matrix_main, [str(m), "--import"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "checkpoints.rel: release: no-such-org/no-such-release:" in err[0] and "set release: DIR" in err[0]
    assert "--model" not in err[0], err[0]
    assert as_matrix_keys("--base-model x: no config.json; pass --base-model DIR, or --model-name y") == \
        "base_model: x: no config.json; set base_model: DIR, or --model-name y"


def test_docs_name_the_directory_import_writes(tmp_path):
    """docs/eval.md says where `--import` puts a release: the matrix's `imports:` directory, runs/released
    by default (it once said `imports/<name>`)."""
    from eval.matrix import _checkpoints, _read

    m = tmp_path / "m.yaml"
    m.write_text("checkpoints:\n  rel: {release: some-org/some-release}\ntasks: {likelihood: {default: ''}}\n")
    p, spec = _read(str(m))
    assert Path(_checkpoints(p, spec)["rel"]["path"]) == Path("runs/released/rel")
    doc = (REPO / "docs" / "eval.md").read_text()
    assert "into `runs/released/<name>`" in doc and "`imports/<name>`" not in doc
