"""Chat templates render under a time, memory and output-size limit wherever they render (data prepare,
eval's chat prompts and lm-eval's apply_chat_template, the HF export): a template that loops
(nested ``range(100000)``), allocates 3 GB (``'x' * 3000000000``) or renders a huge text is one line
naming the template, and the error never holds the rendered text. Within the limits, the rendering is
transformers' own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_pipeline import chat_template as ct
from data_pipeline.chat_template import ChatTemplateError, render_chat_template

pytest.importorskip("transformers")

LOOP = "{%- for i in range(100000) %}{%- for j in range(100000) %}{%- endfor %}{%- endfor %}{{ messages[0].content }}"
HUGE = "{{ 'x' * 3000000000 }}{{ messages[0].content }}"
# Loops only for one message: the check at start passes, the example that triggers it is stopped.
LOOP_ON = ("{%- for m in messages %}{%- if m.content == 'loop' %}{%- for i in range(100000) %}{%- for j in "
           "range(100000) %}{%- endfor %}{%- endfor %}{%- endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
           "{%- if add_generation_prompt %}assistant: {% endif %}")
TAGGED = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.role == 'assistant' %}{% generation %}"
          "{{ m.content }}<|im_end|>{% endgeneration %}{%- else %}{{ m.content }}<|im_end|>{%- endif %}\n"
          "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}")
CHAT = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5. Ünïcode 日本"},
        {"role": "user", "content": "And 3 + 4?"}, {"role": "assistant", "content": "7."}]


@pytest.fixture
def quick(monkeypatch):
    """A 1.5 s time limit for the module-level defaults (what every caller renders under)."""
    monkeypatch.setattr(ct, "RENDER_TIME_LIMIT_S", 1.5)


def test_renders_as_transformers_with_generation_spans():
    from transformers.utils.chat_template_utils import render_jinja_template

    for prompt in (False, True):
        want, spans = render_jinja_template([CHAT], chat_template=TAGGED, return_assistant_tokens_mask=True,
                                            add_generation_prompt=prompt, eos_token="</s>")
        got = render_chat_template(TAGGED, CHAT, add_generation_prompt=prompt, generation_spans=True,
                                   variables={"eos_token": "</s>"})
        assert got == (want[0], [tuple(s) for s in spans[0]])
        assert render_chat_template(TAGGED, CHAT, variables={"eos_token": "</s>"})[1] == []


def test_a_loop_a_3gb_string_and_a_huge_text_are_one_line_naming_the_template():
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"^loop\.jinja: rendering took longer than the limit of 1\.5 s"):
        render_chat_template(LOOP, CHAT, name="loop.jinja", time_limit_s=1.5)
    assert time.monotonic() - t0 < 30  # the worker is killed at the limit (its restart is not counted)
    assert render_chat_template(TAGGED, CHAT[:1])[0].startswith("<|im_start|>user")  # a new worker serves the next
    with pytest.raises(ChatTemplateError, match=r"^huge\.jinja: rendering needs more than the limit of 1024 MiB"):
        render_chat_template(HUGE, CHAT, name="huge.jinja")
    with pytest.raises(ChatTemplateError, match=r"^long: the rendering is 3000 characters, over the limit of 100") as e:
        render_chat_template("{{ 'y' * 3000 }}", CHAT, name="long", max_chars=100)
    assert "yyy" not in str(e.value)
    with pytest.raises(ChatTemplateError, match=r"^own: TemplateError: zzz") as e:  # its own message, cut short
        render_chat_template("{{ raise_exception('z' * 100000) }}", CHAT, name="own")
    assert len(str(e.value)) < 400 and "\n" not in str(e.value)
    with pytest.raises(ChatTemplateError, match="^deep: RecursionError"):
        render_chat_template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", CHAT, name="deep")


@pytest.mark.slow
def test_eval_chat_prompts_and_lm_eval_render_under_the_limit(quick):
    from data_pipeline.tokenizers import load_tokenizer
    from eval.chat_prompt import ChatPrompts, render_text
    from eval.errors import EvalError
    from eval.lmeval_chat import ChatAPI

    tok = load_tokenizer("gpt2")  # the caller's own copy: its chat template stays here
    tok.chat_template = LOOP
    with pytest.raises(ChatTemplateError, match="^--prompt-format tokenizer: the chat template of tokenizer 'gpt2': "
                                                "rendering took longer"):
        ChatPrompts(tok, "tokenizer")  # before any work
    tok.chat_template = LOOP_ON
    prompts = ChatPrompts(tok, "tokenizer")
    assert prompts.ids([{"role": "user", "content": "hi"}]) == tok.encode("user: hi\nassistant: ")
    with pytest.raises(EvalError, match="^--prompt-format tokenizer: the chat template of tokenizer 'gpt2': rendering"):
        prompts.ids([{"role": "user", "content": "loop"}])
    with pytest.raises(EvalError, match="rendering took longer"):
        render_text(LOOP, {}, CHAT[:1])
    api = ChatAPI()
    api.chat_spec = prompts.describe()
    assert api.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "
    with pytest.raises(EvalError, match="rendering took longer"):
        api.apply_chat_template([{"role": "user", "content": "loop"}])


def test_data_prepare_stops_an_example_that_loops(quick, tmp_path):
    import json

    from data_pipeline.prompt_answer import prepare_examples

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}, {"role": "assistant",
                                                                                    "content": "ok"}]}) + "\n"
                           for c in ("fine", "loop")))
    tpl = tmp_path / "t.jinja"
    tpl.write_text(LOOP_ON)
    with pytest.raises(ChatTemplateError, match=f"^--chat-template {tpl}: rendering took longer"):
        prepare_examples(str(src), str(tmp_path / "out"), fmt="chat", tokenizer="gpt2", template="tokenizer",
                         chat_template=str(tpl), seq_len=32, log=lambda m: None)


@pytest.mark.slow
def test_the_export_refuses_a_template_that_loops_before_writing(quick, tmp_path):
    import torch

    from data_pipeline.tokenizers import load_tokenizer
    from helpers import write_recipe
    from model.transformer import Transformer
    from pretrain.config import load_config
    from pretrain.convert.export import export_checkpoint
    from pretrain.convert.from_hf import write_run

    tok_dir = tmp_path / "tok"
    load_tokenizer("gpt2").save(tok_dir, chat_template=LOOP)
    tok = load_tokenizer(str(tok_dir))
    cfg = load_config(write_recipe(tmp_path / "r.yaml"), [f"run.out_dir={tmp_path}", f"data.tokenizer={tok_dir}",
                                                         "model.hidden=16", "model.ffn_hidden=32"])
    cfg.resolve_vocab(tok)
    torch.manual_seed(0)
    write_run(tmp_path / "run", cfg, Transformer(cfg.model).state_dict(), tok, info={}, log=lambda s: None)
    with pytest.raises(ChatTemplateError, match=r"^the chat template of tokenizer .* \(carried into the export's "
                                                r"tokenizer_config.json\): rendering took longer"):
        export_checkpoint(tmp_path / "run", tmp_path / "hf", log=lambda s: None)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("template", [LOOP, HUGE], ids=["loop", "3gb"])
def test_steering_data_prepare_with_a_hostile_template_exits_2_within_60s(tmp_path, template):
    """The issue's check, through the command line at the default limits."""
    from helpers import cli_env

    src = tmp_path / "g.jsonl"
    src.write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n')
    tpl = tmp_path / "hostile.jinja"
    tpl.write_text(template)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "launch.cli", "data", "prepare", "--format", "prompt_answer",
                        "--input", str(src), "--output", str(tmp_path / "out"), "--tokenizer", "gpt2",
                        "--template", "tokenizer", "--chat-template", str(tpl)],
                       capture_output=True, text=True, env=cli_env(), cwd=Path(__file__).resolve().parent.parent,
                       timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 2 and took < 60, (r.returncode, took, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("[data prepare]")]
    assert len(lines) == 1 and lines[0].startswith(f"setdlm data prepare: error: --chat-template {tpl}: rendering ")
    assert "Traceback" not in r.stderr and len(r.stderr) < 2000
