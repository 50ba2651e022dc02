"""Command-line and file mistakes found by trying the commands as users and attackers would: each is
one line naming the option, field or file, exit status 2, before any work. A tokenizer.json that is
not JSON; `RUN:best` / `RUN:STEP` over a step link that leaves the run (as plain RUN refuses it); a
LoRA rank above the layer width and LoRA on a random base; `--protocol paper` against
`--prompt-format plain`, and a model without a chat template (`--chat-template FILE` is the way
out); a model file of another shape behind an intact EMA file; `--out /proc/...`; `--shard -1/2`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import REPO, write_recipe
from test_file_faults import make_checkpoint

DATA = REPO / "tests" / "fixtures" / "eval" / "gsm8k_test.jsonl"


def _one_line(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])




# -- tokenizer files -------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_record", [False, True], ids=["hf directory", "setdlm tokenizer directory"])
def test_a_tokenizer_json_that_is_not_json_is_named(tmp_path, capsys, with_record):
    from data_pipeline.tokenizers import TokenizerError, load_tokenizer
    from launch.cli import main

    d = tmp_path / "tok"
    load_tokenizer("gpt2").save(d)
    if not with_record:
        (d / "setdlm_tokenizer.json").unlink()
    (d / "tokenizer.json").write_text("this is { not JSON")
    with pytest.raises(TokenizerError, match=f"^{d / 'tokenizer.json'}: not a tokenizer.json the tokenizers library"):
        load_tokenizer(str(d))
    src = tmp_path / "t.txt"
    src.write_text("hello world\n")
    assert main(["data", "prepare", "--input", str(src), "--out", str(tmp_path / "o"), "--tokenizer", str(d)]) == 2
    _one_line(capsys.readouterr().err, "tokenizer.json: not a tokenizer.json")


# -- RUN:best / RUN:STEP over links ----------------------------------------------------------------------
def test_selectors_refuse_a_step_link_that_leaves_the_run_as_plain_run_does(tmp_path):
    from pretrain.checkpoint import rundir
    from pretrain.safe_load import CheckpointError

    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    make_checkpoint(root, 2)
    (root / "latest").write_text("step_00000002")
    other = make_checkpoint(tmp_path / "other" / "checkpoints", 4)
    (root / "step_00000004").symlink_to(other)
    rundir.point_best(root, {"tag": "step_00000004", "step": 4, "metric": "val/nll", "value": 1.0, "mode": "min"})
    for sel in ("", ":best", ":4", ":step_00000004", ":2", ":latest"):
        with pytest.raises(CheckpointError, match="step_00000004: a symbolic link to .* outside the run directory"):
            rundir.resolve_checkpoint(f"{run}{sel}")
    (root / "step_00000004").unlink()
    (root / "step_00000004").symlink_to(root / "step_00000002")  # a link inside the run is fine
    assert rundir.resolve_checkpoint(f"{run}:best") == root / "step_00000004"
    assert rundir.resolve_checkpoint(f"{root}:2") == root / "step_00000002"


# -- LoRA ------------------------------------------------------------------------------------------------
def test_lora_rank_above_the_layer_width_and_a_random_base_are_refused(tmp_path, capsys):
    from launch.cli import main
    from pretrain.config import ConfigError, load_config

    recipe = write_recipe(tmp_path / "r.yaml")  # hidden 32: every adapted linear has 32 on one side
    with pytest.raises(ConfigError, match="^train.lora: .* without train.init_from that base is random weights"):
        load_config(recipe, ["train.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"^train.lora.rank: 33 is above the width of the adapted linear qkv \(32 in, "
                                          r"96 out\).*train.lora.rank <= 32"):
        load_config(recipe, ["train.lora.rank=33", "train.lora.random_base=true"])
    with pytest.raises(ConfigError, match=r"train.lora.rank: 33 .* linear fc2 \(64 in, 32 out\)"):
        load_config(recipe, ["train.lora.rank=33", "train.lora.random_base=true", "train.lora.targets=[fc2]"])
    assert load_config(recipe, ["train.lora.rank=32", "train.lora.random_base=true"]).train.lora.rank == 32
    # with init_from the width is the source's: checked once init_from has filled the model section
    assert load_config(recipe, ["train.lora.rank=64", f"train.init_from={tmp_path}"]).train.lora.rank == 64
    assert main(["pretrain", "--config", str(recipe), f"run.out_dir={tmp_path}", "train.lora.rank=4"]) == 2
    _one_line(capsys.readouterr().err, "train.lora:", "train.init_from", "train.lora.random_base")
    assert not (tmp_path / "tiny").exists()


# -- gsm8k's protocol and chat templates -----------------------------------------------------------------
def test_paper_protocol_against_plain_prompts_and_a_model_without_a_chat_template(random_gpt2_run, tmp_path, capsys):
    from eval.cli import main as eval_main

    base = ["gsm8k", "--checkpoint", str(random_gpt2_run), "--data", str(DATA), "--out", str(tmp_path / "o")]
    assert eval_main([*base, "--protocol", "paper", "--prompt-format", "plain"]) == 2
    _one_line(capsys.readouterr().err, "--protocol paper: --prompt-format plain contradicts it", "drop --protocol paper")
    assert eval_main([*base, "--protocol", "paper"]) == 2  # no template: the way out is named, not plain again
    _one_line(capsys.readouterr().err, "--protocol paper: tokenizer 'gpt2' has no chat template",
              "--chat-template FILE", "drop --protocol paper")
    assert eval_main([*base, "--prompt-format", "tokenizer"]) == 2
    _one_line(capsys.readouterr().err, "--prompt-format tokenizer: tokenizer 'gpt2' has no chat template",
              "--chat-template FILE", "--prompt-format plain")
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")
    assert eval_main([*base, "--prompt-format", "chatml", "--chat-template", str(tpl)]) == 2
    _one_line(capsys.readouterr().err, "--chat-template: renders --prompt-format tokenizer, not --prompt-format chatml")
    assert not (tmp_path / "o").exists()


def test_chat_template_option_renders_the_prompts(random_gpt2_run, tmp_path):
    from helpers import eval_result

    from eval.cli import run_task
    from eval.tasks.gsm8k import GSM8KOptions, paper_protocol

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")
    out = tmp_path / "o"
    run_task("gsm8k", ["--checkpoint", str(random_gpt2_run), "--data", str(DATA), "--out", str(out), "--limit", "1",
                       "--chat-template", str(tpl), "--max-new-tokens", "2", "--backend", "direct"])
    _, spec, recs = eval_result(out)
    assert spec["chat"]["source"] == f"--chat-template {tpl}" and spec["template"] == "tokenizer"
    q = json.loads(DATA.read_text().splitlines()[0])["question"]
    assert recs["0"]["prompt"] == f"user: {q}\nassistant:"
    args = GSM8KOptions(out=str(out), data=str(DATA), protocol="paper", chat_template=str(tpl))
    assert paper_protocol(args).prompt_format == "tokenizer"


# -- checkpoint files ------------------------------------------------------------------------------------
def test_a_model_file_of_another_shape_behind_an_intact_ema_file_is_named(tmp_path):
    from pretrain.checkpoint import rundir
    from pretrain.checkpoint.inference import MODEL_FILE, checkpoint_weights
    from pretrain.safe_load import CheckpointError

    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    meta = {"step": 2, "config": {}, "layout": {"tp": 1, "pp": 1, "zero_stage": 0}}
    torch.save({"module": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}}, ckpt / MODEL_FILE)
    torch.save({"shadow": {"w": torch.ones(2, 3)}}, rundir.ema_file(ckpt, 0))
    weights, used_ema = checkpoint_weights(ckpt, meta)
    assert used_ema and torch.equal(weights["w"], torch.ones(2, 3))
    torch.save({"module": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}, ckpt / MODEL_FILE)
    with pytest.raises(CheckpointError, match=rf"{MODEL_FILE}: w has shape \(4, 3\) where ema_mp_rank_00.pt has "
                                              r"\(2, 3\): the checkpoint's files do not belong together"):
        checkpoint_weights(ckpt, meta)
    assert checkpoint_weights(ckpt, meta, ema=False)[0]["w"].shape == (4, 3)  # the model's own load checks that one


# -- output paths and shards -----------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_an_output_under_proc_names_the_option(random_gpt2_run, tmp_path, capsys):
    from eval.cli import main as eval_main
    from launch.cli import main

    assert eval_main(["gsm8k", "--checkpoint", str(random_gpt2_run), "--data", str(DATA), "--out", "/proc/setdlm-x"]) == 2
    _one_line(capsys.readouterr().err, "--out /proc/setdlm-x:")
    assert main(["sample", "--checkpoint", str(random_gpt2_run), "--prompt", "hi", "--out", "/proc/setdlm-x.jsonl"]) == 2
    _one_line(capsys.readouterr().err, "--out /proc/setdlm-x.jsonl:")
    assert not os.path.exists("/proc/setdlm-x")


@pytest.mark.parametrize("shard", ["-1/2", "2/2", "1/0", "a/b"])
def test_a_bad_shard_is_named(random_gpt2_run, tmp_path, capsys, shard):
    from eval.cli import main as eval_main

    assert eval_main(["gsm8k", "--checkpoint", str(random_gpt2_run), "--data", str(DATA), "--out", str(tmp_path / "o"),
                      "--shard", shard]) == 2
    _one_line(capsys.readouterr().err, f"--shard {shard}" if "/" in shard and shard != "a/b" else "--shard: expected I/N")
    assert not (tmp_path / "o").exists()
