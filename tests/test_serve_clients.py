"""`setdlm serve` as real clients use it, on loopback: the openai SDK with every OpenAI field at its
default, LangChain's `OpenAI` and `ChatOpenAI`, lm-eval's `local-completions` and
`local-chat-completions`; what the server honours (logprobs, penalties, logit_bias, echo, chat content
parts, `developer`, `name`, an assistant turn with null content) checked against `generate`; and
vLLM's /tokenize and /detokenize."""

import json

import httpx
import pytest


NEUTRAL = dict(logprobs=None, echo=False, presence_penalty=0, frequency_penalty=0, best_of=1, logit_bias={},
               suffix=None)






@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(srv, body, path="/v1/completions") -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def engine(served, prompt: str, **kw):
    """The engine's own output for a greedy plain prompt (what the server must return)."""
    from model.sampling import SamplingConfig, generate

    cfg = SamplingConfig.from_objective(served.recipe.objective, **kw)
    return generate(served.model, [served.tokenizer.encode(prompt)], cfg, tokenizer=served.tokenizer)[0]


def test_openai_sdk_with_every_field_at_its_default(client):
    plain = client.completions.create(model="tiny", prompt="The for statement", max_tokens=8, temperature=0)
    full = client.completions.create(model="tiny", prompt="The for statement", max_tokens=8, temperature=0,
                                     **NEUTRAL, n=1, stream=False, user="u1", seed=3, top_p=1.0, stop=None)
    assert full.choices[0].text == plain.choices[0].text and full.usage.completion_tokens == 8
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0)
    want = client.chat.completions.create(**chat).choices[0].message.content
    got = client.chat.completions.create(**chat, frequency_penalty=0, presence_penalty=0, logit_bias={}, logprobs=False,
                                         n=1, tools=[], tool_choice="none", response_format={"type": "text"},
                                         store=False, metadata={"k": "v"}, parallel_tool_calls=False,
                                         service_tier="auto", user="u1", modalities=["text"])
    assert got.choices[0].message.content == want


def test_logprobs_with_alternatives_are_the_engines(client, served):
    out = engine(served, "A class", max_new_tokens=6, logprobs=2)
    r = client.completions.create(model="tiny", prompt="A class", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) == 2 for top in lp.top_logprobs)  # 2 alternatives per token
    assert lp.token_logprobs == pytest.approx(out.logprobs, abs=1e-5)
    tok = served.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in out.tokens] and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(tok.decode([t])) for t in out.tokens[:i]) for i in range(6)]
    for top, alts in zip(lp.top_logprobs, out.top_logprobs):
        assert list(top.values()) == pytest.approx([v for _, v in alts], abs=1e-5)
    # streamed: the choice's last event carries every token's logprobs, the same
    parts = list(client.completions.create(model="tiny", prompt="A class", max_tokens=6, temperature=0, logprobs=2,
                                           stream=True))
    carried = [p.choices[0].logprobs for p in parts if p.choices and p.choices[0].logprobs is not None]
    assert len(carried) == 1 and carried[0].token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6) for c in content)  # greedy: the argmax
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(bytes(c.bytes) == c.token.encode() for c in content)


def test_logprobs_0_gives_each_tokens_own_logprob(client):
    """Completions' `logprobs: 0`: no alternatives, but each `top_logprobs` entry holds the chosen token
    (OpenAI's rule: the sampled token is always there), as lm-eval's greedy check reads it."""
    r = client.completions.create(model="tiny", prompt="A class", max_tokens=5, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 5
    assert all(top == {t: v} for top, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs)), lp.top_logprobs


def test_penalties_and_logit_bias_decode_as_the_engine(served, server):
    space = served.tokenizer.encode(" ")[0]
    for fields, kw in [({"frequency_penalty": 1.5, "presence_penalty": 0.5}, dict(frequency_penalty=1.5, presence_penalty=0.5)),
                       ({"logit_bias": {str(space): 100}}, dict(logit_bias={space: 100.0}))]:
        r = post(server, {"prompt": "Lists implement", "max_tokens": 10, "temperature": 0, **fields}).json()
        out = engine(served, "Lists implement", max_new_tokens=10, **kw)
        assert r["choices"][0]["setdlm"]["tokens"] == out.tokens
    assert out.tokens == [space] * 10  # the bias forces the token
    plain = engine(served, "Lists implement", max_new_tokens=10)
    pen = engine(served, "Lists implement", max_new_tokens=10, frequency_penalty=1.5, presence_penalty=0.5)
    assert pen.tokens != plain.tokens


def test_echo(server, client):
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=5, temperature=0)
    assert r.choices[0].text == "def f(x):" + plain.choices[0].text
    parts = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=5, temperature=0, echo=True,
                                      stream=True)
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text
    err = post(server, {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 1}).json()["error"]
    assert err["param"] == "echo" and "prompt's log-probabilities" in err["message"]  # lm-eval's loglikelihood ask


def test_chat_content_parts_developer_name_and_null_assistant_content(server, client):
    def chat(messages):
        r = post(server, {"messages": messages, "max_tokens": 6, "temperature": 0}, "/v1/chat/completions")
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    parts = chat([{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}])
    assert parts == chat([{"role": "user", "content": "hello\nthere"}])  # text parts joined with a newline
    assert chat([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]) == \
        chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert chat([{"role": "user", "content": "hi", "name": "ann"}])
    assert chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                 {"role": "user", "content": "again"}]) == \
        chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}])
    sdk = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hello"}], "name": "ann"}])
    assert sdk.choices[0].message.content is not None
    calls = post(server, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                        "tool_calls": [{"id": "c1", "type": "function", "function": {
                                            "name": "f", "arguments": "{}"}}]}]}, "/v1/chat/completions")
    assert calls.status_code == 400 and calls.json()["error"]["param"] == "messages.1.tool_calls"


def test_long_stop_lists(server, served):
    stops = ["\n\n", "Question:", "</s>", "<|im_end|>", "<|endoftext|>", "Q:", "###"]
    r = post(server, {"prompt": "A class", "max_tokens": 8, "temperature": 0, "stop": stops})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == engine(served, "A class", max_new_tokens=8).text


def test_langchain_openai_and_chat_openai(server, client):
    lc = pytest.importorskip("langchain_openai")
    want = client.completions.create(model="tiny", prompt="The for statement", max_tokens=8, temperature=0)
    llm = lc.OpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny", max_tokens=8, temperature=0,
                    max_retries=0)
    assert llm.invoke("The for statement") == want.choices[0].text
    assert "".join(llm.stream("The for statement")) == want.choices[0].text
    chat = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny", max_tokens=6, temperature=0,
                         max_retries=0)
    want = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]).choices[0].message.content
    assert chat.invoke([("system", "be brief"), ("human", "hello")]).content == want
    assert "".join(c.content for c in chat.stream([("system", "be brief"), ("human", "hello")])) == want


def test_lm_eval_local_completions_and_chat(server, client):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    until = ["\n\n", "Question:", "</s>", "<|im_end|>"]  # 4 stops; lm-eval adds the EOS text as a fifth
    kw = dict(model="tiny", tokenizer_backend=None, tokenized_requests=False, max_gen_toks=8,
              eos_string="<|endoftext|>", max_retries=1)
    prompts = ["The for statement", "A class"]
    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", **kw)
    got = lm.generate_until([Instance("generate_until", {}, (p, {"until": until, "do_sample": False}), i)
                             for i, p in enumerate(prompts)], disable_tqdm=True)
    want = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0, stop=until).choices[0].text
            for p in prompts]
    assert got == want and all(want)
    chat = LocalChatCompletion(base_url=server.url + "/v1/chat/completions", **kw)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    got = chat.generate_until([Instance("generate_until", {}, (JsonChatStr(json.dumps(m)), {"until": until}), i)
                               for i, m in enumerate(msgs)], disable_tqdm=True)
    want = [client.chat.completions.create(model="tiny", messages=m, max_tokens=8, temperature=0,
                                           stop=until).choices[0].message.content for m in msgs]
    assert got == want and all(want)


def test_tokenize_and_detokenize_in_vllms_shape(server, served):
    tok = served.tokenizer
    r = post(server, {"prompt": "Lists implement", "return_token_strs": True}, "/tokenize").json()
    ids = tok.encode("Lists implement")
    assert r == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": [tok.id_to_token(t) for t in ids]}
    msgs = [{"role": "user", "content": "hi"}]
    chat = post(server, {"messages": msgs}, "/tokenize").json()
    usage = post(server, {"messages": msgs, "max_tokens": 2}, "/v1/chat/completions").json()["usage"]
    assert chat["count"] == usage["prompt_tokens"] and chat["token_strs"] is None  # what chat decodes from
    bare = post(server, {"messages": msgs, "add_generation_prompt": False}, "/tokenize").json()
    assert bare["count"] < chat["count"]
    assert post(server, {"tokens": ids}, "/detokenize").json() == {"prompt": "Lists implement"}
    for path, body, param in [("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": [10**12]}, "tokens"),
                              ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
                              ("/tokenize", {"prompt": "x", "continue_final_message": True}, "continue_final_message")]:
        resp = post(server, body, path)
        assert 400 <= resp.status_code < 500 and resp.json()["error"]["param"] == param, (path, body, resp.text)


def test_incremental_detokenisation_equals_decoding_the_whole_prefix(served):
    """Tokens committed out of order, characters split over byte-level tokens: at every step the
    stream's prefix is exactly the decoding of the whole decoded prefix, and the deltas add up."""
    import random

    from model.sampling import SampleOutput
    from model.sampling.observe import StepEvent
    from serve.streaming import ChoiceText

    tok = served.tokenizer
    text = "Größe 日本語の text ✓ — naïve café 🙂 end"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some characters take more than one token
    order = list(range(len(ids)))
    random.Random(0).shuffle(order)
    stream, got, done = ChoiceText(tok, ["café 🙂 x"], None), "", set()
    for step, k in enumerate(range(0, len(order), 3), 1):
        pos = order[k:k + 3]
        done.update(pos)
        decoded = next((i for i in range(len(ids)) if i not in done), len(ids))
        delta, payload = stream.step(StepEvent(0, step, pos, [ids[p] for p in pos], None, (0, len(ids)), decoded))
        assert payload["prefix"] == tok.decode(ids[:decoded])
        got += delta
        assert text.startswith(got)
    delta, _ = stream.finish(SampleOutput(tokens=ids, text=text))
    assert got + delta == text


def test_streamed_text_with_a_stop_regex_equals_the_full_text(server, served):
    free = engine(served, "Return the", max_new_tokens=16).text
    import re

    pattern = re.escape(free[4:7])
    body = {"prompt": "Return the", "max_tokens": 16, "temperature": 0, "setdlm": {"stop_regex": pattern}}
    full = post(server, body).json()["choices"][0]
    assert full["setdlm"]["stop_reason"] == "regex" and full["text"] == free[:7]
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == full["text"]


def test_the_lm_eval_command_of_the_docs(server, client):
    """docs/serve.md's `lm_eval --model local-completions --model_args ...`: its model and model_args (the
    URL and model name made this server's) built as the command builds them (lm-eval's registry and
    argument string), then a generation task's requests: lm-eval finds /tokenizer_info, tokenises
    through /tokenize (no hub tokenizer named after the model) and sends token prompts; each answer is
    the server's own completion of the text."""
    import re

    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from helpers import REPO

    cmd = re.search(r"^lm_eval --model (\S+) --model_args (\S+)", (REPO / "docs" / "serve.md").read_text(), re.M)
    model = cmd.group(1)
    args = cmd.group(2).replace("http://127.0.0.1:8000", server.url).replace("model=quickstart", "model=tiny")
    assert model == "local-completions" and "tokenizer" not in args  # the command as documented, nothing added
    lm = get_model(model).create_from_arg_string(args, {"batch_size": 1, "max_batch_size": None, "device": None})
    assert lm.tokenizer_backend == "remote" and lm.tokenized_requests  # found /tokenizer_info
    prompts = ["The for statement", "A class"]
    until = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
    got = lm.generate_until([Instance("generate_until", {}, (p, dict(until)), i) for i, p in enumerate(prompts)],
                            disable_tqdm=True)
    want = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                      stop=["\n\n", "<|endoftext|>"]).choices[0].text for p in prompts]
    assert got == want and all(want)
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 64
