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
