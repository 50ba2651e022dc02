"""What the README's commands need is installed by `scripts/install.sh --all` (the serve and eval
extras), the README says which extra each command needs, and a command whose extra is missing says
so in one line before it reads a checkpoint."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from helpers import REPO

SCRIPT = REPO / "scripts" / "install.sh"
# command -> {extra: modules it must provide}
NEEDS = {"setdlm serve": {"serve": ["aiohttp"]},
         "setdlm eval": {"eval": ["rouge_score", "mauve", "matplotlib"], "lm-eval": ["lm_eval"]}}
DIST = {"aiohttp": "aiohttp", "rouge_score": "rouge-score", "mauve": "mauve-text", "matplotlib": "matplotlib",
        "lm_eval": "lm-eval"}


def _dry(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args, "--dry-run"], capture_output=True, text=True, timeout=60)


def test_install_all_installs_what_every_command_needs():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert _dry().stdout.strip() == "[install] would install ."
    line = _dry("--all").stdout.strip()
    chosen = set(line.removeprefix("[install] would install .[").removesuffix("]").split(","))
    assert chosen == {"serve", "eval", "lm-eval"}, line
    assert chosen < set(_dry("--test").stdout.strip().removeprefix("[install] would install .[").removesuffix("]")
                        .split(","))
    for command, need in NEEDS.items():
        for extra, modules in need.items():
            assert extra in chosen, (command, extra)
            for mod in modules:
                assert any(req.startswith(DIST[mod]) for req in extras[extra]), (extra, mod)
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/install.sh --all" in readme
    for text in ("`setdlm serve` needs `.[serve]`", "`setdlm eval` needs `.[eval]`", "`.[lm-eval]`"):
        assert text in " ".join(readme.split()), text


def test_an_unknown_install_option_is_one_line():
    r = subprocess.run(["bash", str(SCRIPT), "--everything"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (
        "scripts/install.sh: error: unknown option --everything (valid: --all, --test, --dry-run)")
    assert not r.stdout


@pytest.mark.parametrize("task,module,text", [
    ("infill", "rouge_score", "infill: ROUGE needs the `rouge-score` package: pip install 'setdlm[eval]'"),
    ("summarize", "rouge_score", "summarize: ROUGE needs the `rouge-score` package"),
    ("uncond", "mauve", "uncond: MAUVE needs the `mauve-text` package"),
])
def test_a_missing_eval_extra_is_one_line_before_the_checkpoint(tmp_path, capsys, monkeypatch, task, module, text):
    from eval.cli import main as eval_main

    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    argv = [task, "--checkpoint", str(tmp_path / "no-such-run"), "--out", str(tmp_path / "o")]
    if task != "uncond":
        argv += ["--data", str(tmp_path / "no-such-data.csv")]
    assert eval_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and text in err and "no-such" not in err, err
