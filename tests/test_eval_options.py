"""The typed options of `setdlm eval TASK` and `setdlm sample`: the flags and defaults the commands had
before their options were typed, one-line errors that name the flag (exit status 2, no traceback,
SETDLM_DEBUG=1 keeps it), `--describe` listing every option, and SamplingConfig refusing what it
used to accept. No model is trained here."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from helpers import REPO, cli_env

from common.options import option_rows
from eval import api
from eval.errors import EvalError, OptionError
from eval.sample import SampleOptions, build_parser
from eval.tasks import TASKS
from model import families

# The flags of every command as the argparse parsers declared them before (kind, default, choices);
# seed: the default the API applied (0; likelihood: the recipe's run.seed).
RUN = {"--checkpoint": ("str", None), "--out": ("str", "required"), "--seed": ("int", 0), "--limit": ("int", 0),
       "--shard": ("str", None), "--overwrite": ("switch", False), "--no-ema": ("switch", False),
       "--device": ("str", None), "--no-merge": ("switch", False), "--merge-timeout": ("float", 0.0)}
FAMILY = families.names()
DECODING = {"--family": ("str", None, FAMILY), "--window": ("int", None), "--threshold": ("float", None),
            "--block-size": ("int", None), "--steps": ("int", None), "--steps-per-block": ("int", None),
            "--remasking": ("str", "confidence", ("confidence", "random")), "--temperature": ("float", 0.0),
            "--top-k": ("int", 0), "--top-p": ("float", 1.0), "--repetition-penalty": ("float", 1.0),
            "--max-new-tokens": ("int", 128), "--batch-size": ("int", 1)}
BEFORE = {
    "likelihood": {**RUN, "--seed": ("int", None), "--data": ("str", None), "--text": ("str", None),
                   "--batch-size": ("int", None), "--max-batches": ("int", 0), "--orders": ("int", 1), "--dp": ("int", 1),
                   "--precision": ("str", None, ("auto", "fp32", "bf16")), "--match-training": ("switch", False)},
    "gsm8k": {**RUN, **DECODING, "--threshold": ("float", 0.9), "--max-new-tokens": ("int", 256),
              "--data": ("str", "required"), "--fewshot": ("int", 0), "--fewshot-data": ("str", None),
              "--backend": ("str", "auto", ("auto", "lm-eval", "direct")),
              "--prompt-format": ("str", "plain", ("plain", "chatml"))},
    "infill": {**RUN, **DECODING, "--data": ("str", "required"), "--span": ("str", "3", ("2-4", "3")),
               "--preset": ("str", "default", ("default", "paper"))},
    "summarize": {**RUN, **DECODING, "--data": ("str", "required"), "--template": ("str", "{article}\n\nTL;DR:"),
                  "--stop": ("append", None)},
    "uncond": {**RUN, **DECODING, "--temperature": ("float", 1.0), "--num-samples": ("int", 256),
               "--length": ("int", None), "--reference": ("str", None), "--featurizer": ("str", "minilm"),
               "--scorer": ("str", None), "--mauve-buckets": ("str", "auto"), "--stop-on-eos": ("switch", False)},
    "throughput": {**RUN, **DECODING, "--max-new-tokens": ("int", 256), "--prompts": ("str", None),
                   "--prompt-tokens": ("int", 0), "--num-examples": ("int", 16), "--warmup": ("int", 2),
                   "--batch-sizes": ("str", "1"), "--sweep": ("append", ()), "--scorer": ("str", None),
                   "--no-eos-stop": ("switch", False), "--compile": ("switch", False)},
    "sample": {**{k: v for k, v in DECODING.items()}, "--max-new-tokens": ("int", 64), "--batch-size": ("int", 16),
               "--checkpoint": ("str", "required"), "--prompt": ("append", None), "--infill": ("int", None),
               "--suffix": ("str", ""), "--prompts-file": ("str", None), "--out": ("str", None),
               "--seed": ("int", None), "--stop": ("append", ()), "--stop-regex": ("str", None),
               "--ignore-eos": ("switch", False), "--no-ema": ("switch", False), "--device": ("str", None),
               "--dtype": ("str", "fp32", ("fp32", "bf16", "fp16")), "--json": ("switch", False),
               "--trace": ("str", None)},  # added with the trace page (issue 21)
}

# Flags added since, with the issue that added them: --overlong (issue 24) on every task that decodes.
ADDED = {t: {"--overlong": ("str", "skip", ("skip", "truncate", "error"))}
         for t in ("gsm8k", "infill", "summarize", "uncond", "throughput")}
# Issue 20 (the paper's GSM8K protocol): --protocol paper; --prompt-format tokenizer; --max-new-tokens unset
# (None) takes min(256, max_seq_len - the longest prompt) instead of a fixed 256 that did not fit L = 256.
ADDED["gsm8k"].update({"--protocol": ("str", None, ("paper",)), "--max-new-tokens": ("int", None),
                       "--prompt-format": ("str", "plain", ("plain", "chatml", "tokenizer"))})
# Issue 29: --prompt-format unset (plain; tokenizer with --protocol paper or --chat-template), so an explicit
# --prompt-format plain under --protocol paper is a contradiction; --chat-template FILE for a model without one.
ADDED["gsm8k"].update({"--prompt-format": ("str", None, ("plain", "chatml", "tokenizer")),
                       "--chat-template": ("str", None)})
# Issue 28 (the released checkpoints' decoding mode): --cache-order on every command that decodes.
ADDED["sample"] = {}
for _t in ("gsm8k", "infill", "summarize", "uncond", "throughput", "sample"):
    ADDED[_t]["--cache-order"] = ("str", None, ("position", "first_hitting"))


def _flags(cls) -> dict:
    """flag -> (kind, default[, choices]) read from an options class."""
    from typing import Literal, get_origin

    from common.options import _base_type, _repeatable
    from common.schema import _literal_choices

    out = {}
    for f in dataclasses.fields(cls):
        fi = cls.__pydantic_fields__[f.name]
        t = _base_type(fi)
        kind = "switch" if t is bool else "append" if _repeatable(fi) else "str" if get_origin(t) is Literal else t.__name__
        default = "required" if fi.is_required() else fi.default
        choices = _literal_choices(fi.annotation)
        out["--" + f.name.replace("_", "-")] = (kind, default, tuple(choices)) if choices else (kind, default)
    return out


@pytest.mark.parametrize("command", [*TASKS, "sample"])
def test_every_flag_and_default_is_kept(command):
    cls = SampleOptions if command == "sample" else api.options_class(command)
    assert _flags(cls) == {**BEFORE[command], **ADDED.get(command, {})}


@pytest.mark.parametrize("command", [*TASKS, "sample"])
def test_the_parser_is_generated_from_the_options(command):
    parser = build_parser() if command == "sample" else api.task_parser(command)
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    assert flags == set(BEFORE[command]) | set(ADDED.get(command, {})) | {"-h", "--describe"}


def test_argv_and_keywords_give_the_same_options():
    argv = ["--checkpoint", "runs/x", "--out", "o", "--data", "g.jsonl", "--window", "8", "--threshold", "1",
            "--no-ema", "--fewshot", "2", "--fewshot-data", "t.jsonl", "--backend", "direct"]
    opts = api.from_argv("gsm8k", argv)
    assert opts == api.options("gsm8k", checkpoint="runs/x", out="o", data="g.jsonl", window=8, threshold=1.0,
                               no_ema=True, fewshot=2, fewshot_data="t.jsonl", backend="direct")
    assert opts.threshold == 1.0 and opts.seed == 0 and opts.max_new_tokens is None  # unset: from the model (issue 20)
    thr = api.from_argv("throughput", ["--out", "o", "--sweep", "threshold=0.5", "--sweep", "window=2,4"])
    assert thr.sweep == ("threshold=0.5", "window=2,4")
    assert api.options("throughput", out="o", sweep=["threshold=0.5"]).sweep == ("threshold=0.5",)


@pytest.mark.parametrize("values,message", [
    (dict(window=2.5), "--window (sampling.window): expected an integer >= 1, got 2.5"),
    (dict(window=0), "--window (sampling.window): must be >= 1, got 0"),
    (dict(top_p=1.5), "--top-p (sampling.top_p): must be in (0.0, 1.0], got 1.5"),
    (dict(family="gpt"), f"--family (sampling.family): must be one of {', '.join(FAMILY)}, got 'gpt'"),
    (dict(fewshot=-1), "--fewshot: must be >= 0, got -1"),
    (dict(limit=True), "--limit: expected an integer >= 0, got True"),
    (dict(backend="harness"), "--backend: must be one of auto, lm-eval, direct, got 'harness'"),
    (dict(data=None), "--data: expected a string, got None"),
])
def test_a_bad_option_is_one_line_naming_the_flag(values, message):
    with pytest.raises(OptionError) as e:
        api.options("gsm8k", **{"out": "o", "data": "g.jsonl", **values})
    assert str(e.value) == message and isinstance(e.value, EvalError)


def test_checks_across_options_name_the_flags():
    with pytest.raises(OptionError, match="--data and --text: give one"):
        api.options("likelihood", out="o", data="d", text="t.txt")
    with pytest.raises(OptionError, match="--match-training: sets the data"):
        api.options("likelihood", out="o", match_training=True, orders=2, dp=2)
    with pytest.raises(OptionError, match=r"--template: must contain \{article\}"):
        api.options("summarize", out="o", data="d.csv", template="TL;DR:")
    with pytest.raises(OptionError, match="--suffix needs --infill N"):
        SampleOptions(checkpoint="c", prompt=("x",), suffix="y")
    with pytest.raises(OptionError, match="--mauve-buckets: invalid value"):
        api.options("uncond", out="o", mauve_buckets="many")


@pytest.mark.parametrize("argv,needle", [
    (["eval", "gsm8k", "--window", "2.5"], "setdlm eval gsm8k: error: --window (sampling.window): expected an integer"),
    (["eval", "likelihood", "--out", "o", "--orders", "0"], "setdlm eval likelihood: error: --orders: must be >= 1, got 0"),
    (["sample", "--checkpoint", "c", "--prompt", "x", "--window", "2.5"],
     "setdlm sample: error: --window (sampling.window): expected an integer"),
])
@pytest.mark.slow
def test_the_command_line_error_is_one_line_with_exit_status_2(argv, needle):
    p = _cli(argv)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and needle in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_setdlm_debug_0_is_off_and_1_keeps_the_traceback():
    argv = ["sample", "--checkpoint", "c", "--prompt", "x", "--top-p", "0"]
    p = _cli(argv, SETDLM_DEBUG="0")  # `setdlm sample` used to re-raise on any value
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--top-p (sampling.top_p)" in p.stderr, p.stderr
    p = _cli(argv, SETDLM_DEBUG="1")
    assert p.returncode != 0 and "Traceback" in p.stderr and "OptionError" in p.stderr


def _cli(argv, **env):
    return subprocess.run([sys.executable, "-m", "launch.cli", *argv], cwd=REPO, env={**cli_env(), **env},
                          capture_output=True, text=True, timeout=120)


def _describe_rows(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines() if line.startswith("  --")}


@pytest.mark.parametrize("command", [*TASKS, "sample"])
def test_describe_lists_every_option_with_type_range_and_default(command, capsys):
    from launch.cli import main

    argv = ["sample", "--describe"] if command == "sample" else ["eval", command, "--describe"]
    assert main(argv) == 0
    rows = _describe_rows(capsys.readouterr().out)
    cls = SampleOptions if command == "sample" else api.options_class(command)
    expected = {flag: (typ, default, desc) for flag, typ, default, desc in option_rows(cls)}
    assert set(rows) == set(BEFORE[command]) | set(ADDED.get(command, {}))
    for flag, (typ, default, desc) in expected.items():
        assert desc and typ in rows[flag] and f"  {default}  " in rows[flag] + "  " and desc in rows[flag], rows[flag]
    if command != "likelihood":
        assert "int >= 1" in rows["--window"] and " | ".join(FAMILY) in rows["--family"]
        assert "float in (0.0, 1.0]" in rows["--top-p"]
    if command == "gsm8k":
        assert rows["--threshold"].split()[1:4] == ["float", ">=", "0.0"] and " 0.9 " in rows["--threshold"]
        assert " required " in rows["--out"] and "min(256, max_seq_len" in rows["--max-new-tokens"]  # issue 20
    if command == "likelihood":
        assert " int >= 1 " in rows["--orders"] and "auto | fp32 | bf16" in rows["--precision"]


def test_unknown_task_and_option_are_one_line(capsys):
    from eval.cli import main

    assert main(["gsmk8"]) == 2
    assert capsys.readouterr().err.strip() == ("setdlm eval: error: unknown task 'gsmk8'; valid: likelihood, gsm8k, "
                                               "infill, summarize, uncond, throughput, merge, frontier, matrix")
    with pytest.raises(EvalError, match="unknown option 'order'"):
        api.options("likelihood", out="o", order=2)


# ------------------------------------------------------------------------------------------ SamplingConfig
@pytest.mark.parametrize("values,message", [
    (dict(window=2.5), "sampling.window: must be an integer >= 1 (or null), got 2.5"),
    (dict(max_new_tokens=True), "sampling.max_new_tokens: must be an integer >= 0, got True"),
    (dict(threshold=float("nan")), "sampling.threshold: must be a finite number (or null), got nan"),
    (dict(stop="abc"), "sampling.stop: must be a list, got 'abc'"),
    (dict(top_k=1.0), "sampling.top_k: must be an integer >= 0, got 1.0"),
    (dict(windw=4), "sampling.windw: unknown key; valid keys: family,"),
])
def test_sampling_config_is_a_typed_section(values, message):
    from model.sampling import SamplingConfig

    with pytest.raises(ValueError) as e:
        SamplingConfig(**values)
    assert str(e.value).startswith(message)
    cfg = SamplingConfig()
    with pytest.raises(ValueError, match="sampling.window: must be an integer"):
        cfg.window = 2.5  # assignments are checked too


def test_sampling_config_fields_are_described():
    from common.schema import field_rows
    from model.sampling import SamplingConfig

    rows = field_rows(SamplingConfig, "sampling")
    assert len(rows) == len(dataclasses.fields(SamplingConfig)) and all(r[3] for r in rows)
    assert ("sampling.window", "int >= 1 or null", "null") == rows[2][:3]
