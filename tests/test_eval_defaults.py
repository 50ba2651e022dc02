"""Evaluation numbers that cannot mislead: the Python API equals the CLI; the scorer is the likelihood
bound; impossible options fail before the model loads and leave --out absent; truncation, EMA use
and tiny MAUVE samples are reported; GSM8K prefers a stated answer; the infilling paper preset."""

import json
import math
from pathlib import Path

import pytest

from helpers import REPO, write_recipe

from eval import api
from eval.cli import main as eval_main
from eval.errors import EvalError

FIX = REPO / "tests" / "fixtures" / "eval"


def _train(tmp, name, **sections):
    import torch

    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    torch.set_num_threads(1)
    recipe = write_recipe(tmp / f"{name}.yaml", run={"name": name, "seed": 7},
                          train={"max_steps": 4, "eval_every": 4, "save_every": 4, "eval_batches": 1, "log_every": 4},
                          **sections)
    Trainer(load_config(recipe, [f"run.out_dir={tmp}"])).train()
    return tmp / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_parallel):
    tmp = tmp_path_factory.mktemp("evaldefaults")
    return {"setdlm": _train(tmp, "sd"), "ar": _train(tmp, "ar", objective={"name": "ar"})}


def _metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text())["metrics"]


# ------------------------------------------------------------------------------------------ API == CLI
def test_python_api_and_cli_give_identical_metrics(runs, tmp_path):
    ck = str(runs["setdlm"])
    assert eval_main(["likelihood", "--checkpoint", ck, "--out", str(tmp_path / "cli"), "--orders", "2",
                      "--max-batches", "1"]) == 0
    m = api.likelihood(checkpoint=ck, out=tmp_path / "api", orders=2, max_batches=1)
    assert m == _metrics(tmp_path / "cli")
    opts = api.options("likelihood", checkpoint=ck, out=str(tmp_path / "x"))
    with pytest.raises(Exception):
        opts.orders = 3  # frozen: a task cannot mutate its options
    with pytest.raises(EvalError, match="--orders: expected an integer"):
        api.options("likelihood", checkpoint=ck, out="o", orders="2")
    with pytest.raises(EvalError, match="unknown option 'order'"):
        api.options("likelihood", checkpoint=ck, out="o", order=2)
    with pytest.raises(EvalError, match="--out: required"):
        api.options("likelihood", checkpoint=ck)


def test_eval_does_not_import_launch():
    import subprocess
    import sys

    code = ("import sys, eval.api, eval.cli, eval.tasks.likelihood, eval.tasks.uncond, eval.shard, eval.units, eval.merge; "
            "from eval.shard import detect_shard; detect_shard(); "
            "print(sorted(m for m in sys.modules if m == 'launch' or m.startswith('launch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------ scorer
def test_scorer_is_the_likelihood_bound_of_the_text(runs, tmp_path):
    """The scorer of uncond/throughput and `eval likelihood --text` on a file with the same text: the
    AR scorer gives the identical number; the SetDLM scorer's mean over seeds agrees within the
    Monte-Carlo error with the likelihood task's mean over orders."""
    import torch

    from eval.scoring import Scorer

    text = ("The for statement iterates over the items of any sequence, in the order that they appear in the "
            "sequence. Each item is assigned to the target list in turn.")
    f = tmp_path / "one.txt"
    f.write_text(text)
    ar = Scorer(str(runs["ar"]), torch.device("cpu"))
    nll, n = ar.nll(text)
    m = api.likelihood(checkpoint=str(runs["ar"]), out=tmp_path / "ar", text=str(f))
    assert n == m["tokens"] and nll / n == pytest.approx(m["nll"], rel=1e-9)

    sd = Scorer(str(runs["setdlm"]), torch.device("cpu"))
    K = 24
    draws = [sd.nll(text, seed=s) for s in range(K)]
    per = [a / b for a, b in draws]
    mu = sum(per) / K
    se = math.sqrt(sum((p - mu) ** 2 for p in per) / (K - 1) / K)
    m = api.likelihood(checkpoint=str(runs["setdlm"]), out=tmp_path / "sd", text=str(f), orders=K)
    assert draws[0][1] == m["tokens"]
    se_l = m["nll_std_over_orders"] / math.sqrt(K)
    assert abs(mu - m["nll"]) < 4 * math.hypot(se, se_l) + 1e-9, (mu, se, m["nll"], se_l)


# ------------------------------------------------------------------------------------------ impossible options
@pytest.mark.parametrize("task,extra", [
    # MDLM decoding re-reads prompt + new tokens (SW-SetDLM would decode past max_seq_len: test_eval_overlong.py)
    ("gsm8k", ["--data", str(FIX / "gsm8k_test.jsonl"), "--max-new-tokens", "64", "--backend", "direct", "--family", "mdlm"]),
    ("summarize", ["--data", str(FIX / "cnndm.csv"), "--max-new-tokens", "60"]),
    ("throughput", ["--prompt-tokens", "4", "--max-new-tokens", "64"]),
    ("uncond", ["--num-samples", "100000", "--length", "8", "--featurizer", "self"]),
    ("uncond", ["--num-samples", "4", "--length", "65", "--featurizer", "self"]),
])
def test_impossible_options_fail_before_loading_and_leave_no_out(runs, tmp_path, capsys, monkeypatch, task, extra):
    import eval.models as models

    def no_load(self):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models.Checkpoint, "model", property(no_load))
    out = tmp_path / "out"
    assert eval_main([task, "--checkpoint", str(runs["setdlm"]), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert ("--max-new-tokens" in err or "--num-samples" in err or "--length" in err) and "Traceback" not in err
    assert not out.exists()


def test_generate_refuses_to_decode_past_max_seq_len():
    from model.sampling import SamplingConfig, generate
    from model.sampling.testing import tiny_model

    model = tiny_model(max_seq_len=16)
    # MDLM re-reads the whole sequence; the cached families decode past it by dropping the oldest cache
    # entries, as the reference does (tests/test_sampling_overflow.py), but their prompt must fit
    with pytest.raises(ValueError, match="exceed the model's max_seq_len 16"):
        generate(model, [[1, 2, 3, 4]], SamplingConfig(family="mdlm", max_new_tokens=13))
    assert len(generate(model, [[1, 2, 3, 4]], SamplingConfig(family="mdlm", max_new_tokens=12))[0].tokens) <= 12
    with pytest.raises(ValueError, match="17 prompt tokens exceed the model's max_seq_len 16"):
        generate(model, [list(range(1, 18))], SamplingConfig(family="setdlm", max_new_tokens=1))


# ------------------------------------------------------------------------------------------ what is reported
def test_truncation_and_weights_are_reported(runs, tmp_path):
    out = tmp_path / "g"
    m = api.gsm8k(checkpoint=str(runs["setdlm"]), out=out, data=str(FIX / "gsm8k_test.jsonl"), backend="direct",
                  fewshot=2, fewshot_data=str(FIX / "gsm8k_test.jsonl"), max_new_tokens=8, limit=2, overlong="truncate")
    assert m["prompts_cut"] == 2 and m["prompt_tokens_cut"] > 0  # two solved examples do not fit 64 tokens
    summary = (out / "summary.md").read_text()
    assert "**TRUNCATED**: 2 prompts" in summary
    assert "raw weights (the checkpoint has no EMA weights)" in summary and "EMA True" not in summary
    spec = json.loads((out / "metrics.json").read_text())["spec"]
    assert spec["checkpoint"]["ema"] is False and spec["checkpoint"]["ema_requested"] is True


def test_mauve_is_not_reported_for_a_handful_of_samples():
    import numpy as np

    pytest.importorskip("mauve")
    from eval.metrics import mauve_report

    rng = np.random.default_rng(0)
    same = np.zeros((20, 16)) + 1e-3 * rng.normal(size=(20, 16))  # 20 identical (whitespace-only) samples
    refs = rng.normal(size=(20, 16))
    r = mauve_report(same, refs)
    assert r["mauve"] is None and "too few" in r["mauve_warning"] and r["mauve_small_sample"] is not None
    big = mauve_report(rng.normal(size=(120, 16)), rng.normal(size=(120, 16)))
    assert big["mauve"] is not None and "mauve_warning" not in big


def test_gsm8k_prefers_a_stated_answer_over_the_last_number():
    from eval.metrics import extract_answer

    assert extract_answer("So the answer is 18. She has 3 eggs left over for tomorrow.") == ("18", "phrase")
    assert extract_answer("Final answer: $1,200. That is 2 payments.") == ("1200", "phrase")
    assert extract_answer("#### 5\nThe answer is 7") == ("5", "####")
    assert extract_answer("3 apples and 4 pears") == ("4", "last_number")


def test_infill_paper_preset(runs, tmp_path):
    from eval.tasks.infill import InfillTask
    from eval.shard import Shard

    opts = api.options("infill", checkpoint=str(runs["setdlm"]), out=str(tmp_path / "i"),
                       data=str(FIX / "rocstories_cloze.csv"), preset="paper")
    task = InfillTask(opts, Shard())
    (a, n, b), _ = task.part(task.stories[0])
    eos = task.tokenizer.eos_id
    assert a[0] == eos and b[-1] == eos  # gpt2: BOS = EOS = <|endoftext|>
    assert task.sampling.repetition_penalty == 1.2 and task.spec()["framing"] is True
    plain = InfillTask(api.options("infill", checkpoint=str(runs["setdlm"]), out=str(tmp_path / "j"),
                                   data=str(FIX / "rocstories_cloze.csv")), Shard())
    (a2, n2, b2), _ = plain.part(plain.stories[0])
    assert a2 == a[1:] and b2 == b[:-1] and n2 == n and plain.sampling.repetition_penalty == 1.0


def test_hf_export_decodes_past_its_positions_but_refuses_a_prompt_that_does_not_fit():
    """Past max_position_embeddings the export drops its oldest cache entries, as the stack's sampler
    does (tests/test_convert_hf.py compares them token for token); the prompt, prefilled at once, must fit."""
    pytest.importorskip("transformers")
    import torch

    from model.convert.hf_code.configuration_setdlm import SetDLMConfig
    from model.convert.hf_code.modeling_setdlm import SetDLMForMaskedLM

    torch.manual_seed(0)
    cfg = SetDLMConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       max_position_embeddings=12, mask_token_id=23, eos_token_id=22, set_diffusion={"inference_mask": "causal", "decoding": "set_window", "set_size": 2})
    m = SetDLMForMaskedLM(cfg).eval()
    with pytest.raises(ValueError, match="13 prompt tokens exceed max_position_embeddings 12"):
        m.set_diffusion_generate([list(range(1, 14))], max_new_tokens=2)
    assert len(m.set_diffusion_generate([[1, 2, 3, 4]], max_new_tokens=8, stop_on_eos=False).sequences[0]) == 8
    assert len(m.set_diffusion_generate([[1, 2, 3, 4]], max_new_tokens=20, stop_on_eos=False).sequences[0]) == 20
