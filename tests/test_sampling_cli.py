"""`setdlm sample` (eval.sample.main) against a checkpoint written by the trainer."""

import json

import pytest

from helpers import write_recipe


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_parallel, one_thread):
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    tmp = tmp_path_factory.mktemp("sample_cli")
    recipe = write_recipe(tmp / "r.yaml")
    cfg = load_config(recipe, [f"run.out_dir={tmp}", "train.max_steps=2", "train.save_every=2", "train.eval_every=2",
                               "train.eval_batches=1", "train.sample_at_end=false"])
    Trainer(cfg).train()
    return tmp / "tiny"


def test_prompt_and_infill(run_dir, capsys):
    from eval.sample import main

    assert main(["--checkpoint", str(run_dir), "--prompt", "The for statement", "--max-new-tokens", "8",
                 "--threshold", "0.5", "--json", "--device", "cpu"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(out) == 1 and out[0]["prompt"] == "The for statement" and isinstance(out[0]["text"], str)
    assert 1 <= len(out[0]["tokens"]) <= 8 and out[0]["steps"] >= 1
    assert main(["--checkpoint", str(run_dir), "--prompt", "def f(", "--infill", "6", "--suffix", ") return x",
                 "--json", "--family", "bd3lm"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 6 and out["suffix"] == ") return x" and out["stop_reason"] == "length"


def test_prompts_file_and_resume(run_dir, tmp_path, capsys):
    from eval.sample import main

    src = tmp_path / "in.jsonl"
    rows = [{"id": i, "prompt": p} for i, p in enumerate(["The", "A class", "import", "for x in"])]
    rows.append({"id": 4, "prompt": "x =", "suffix": " + 1", "infill_length": 3})
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    args = ["--checkpoint", str(run_dir), "--prompts-file", str(src), "--out", str(out), "--batch-size", "2",
            "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "1"]
    assert main(args) == 0
    first = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in first] == [0, 1, 2, 3, 4] and len(first[4]["tokens"]) == 3
    # a torn run: keep two complete lines and half of a third, then resume
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])
    assert main(args) == 0
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in again] == [0, 1, 2, 3, 4]
    assert again[:2] == first[:2]


def test_bad_input_is_reported(run_dir, tmp_path, capsys):
    from eval.sample import main

    assert main(["--checkpoint", str(run_dir)]) == 2
    assert "--prompt" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    assert main(["--checkpoint", str(run_dir), "--prompts-file", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["--checkpoint", str(run_dir), "--prompt", "x", "--top-p", "0"]) == 2
    assert "sampling.top_p" in capsys.readouterr().err
