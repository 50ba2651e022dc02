"""transformers' `generate()` on exports. A setdlm-code export (SW-SetDLM, and an AR model outside the
stock shapes) runs set decoding behind transformers' conventions (max_new_tokens, do_sample,
temperature, top_k, top_p, GenerationConfig, padded batches) and, greedy, gives the tokens of setdlm's
own `model.sampling.generate`. A stock AR export suppresses MASK in generation_config.json, so its
`generate()` equals setdlm's greedy tokens even where the MASK logit would be the largest."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import write_recipe

pytestmark = pytest.mark.slow
D, NEW = 4, 10


def _run(tmp, name, overrides, edit=None):
    """A run directory of random weights (written as `convert from-hf` writes one); `edit(state, cfg)`
    changes the weights first."""
    from data_pipeline.tokenizers import load_tokenizer
    from model.transformer import Transformer
    from pretrain.config import load_config
    from pretrain.convert.from_hf import write_run

    tok = load_tokenizer("gpt2")
    cfg = load_config(write_recipe(tmp / f"{name}.yaml"), [f"run.out_dir={tmp}", f"objective.set_size={D}", *overrides])
    cfg.resolve_vocab(tok)
    torch.manual_seed(3)
    state = Transformer(cfg.model).state_dict()
    if edit is not None:
        edit(state, cfg)
    write_run(tmp / name, cfg, state, tok, info={}, log=lambda s: None)
    return tmp / name


def _ours(run, prompts, **kw):
    from model.sampling import SamplingConfig, generate
    from pretrain.checkpoint.inference import load_model

    model, tok, cfg = load_model(run)
    outs = generate(model, prompts, SamplingConfig(family=cfg.objective.name, max_new_tokens=NEW, **kw),
                    mask_id=cfg.model.mask_id, eos_id=tok.eos_id)
    return [list(o.tokens) for o in outs], tok


def _new_tokens(seqs: torch.Tensor, width: int, eos: int) -> list[list[int]]:
    """The new tokens of each row, cut before the EOS that ended it (setdlm's convention)."""
    rows = []
    for r in seqs[:, width:].tolist():
        rows.append(r[:r.index(eos)] if eos in r else r)
    return rows


@pytest.fixture(scope="module")
def setdlm_export(tmp_path_factory):
    from pretrain.convert.export import export_checkpoint

    tmp = tmp_path_factory.mktemp("hfgen")
    run = _run(tmp, "sd", [])
    return run, export_checkpoint(run, tmp / "sd-hf", log=lambda s: None)


def test_generate_follows_transformers_and_equals_setdlms_greedy_tokens(setdlm_export):
    from transformers import AutoModelForMaskedLM, GenerationConfig

    from data_pipeline.tokenizers import load_tokenizer

    run, export = setdlm_export
    tok = load_tokenizer("gpt2")
    ids = [tok.encode(t) for t in ("The meaning of", "In the beginning there was a")]
    ours, _ = _ours(run, ids, window=D, threshold=None)
    P = max(map(len, ids))
    pad = tok.eos_id
    batch = torch.tensor([[pad] * (P - len(p)) + p for p in ids])  # left padding, as transformers pads for generate
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in ids])
    m = AutoModelForMaskedLM.from_pretrained(str(export), trust_remote_code=True).eval()
    assert m.generation_config.set_diffusion["window"] == D  # generation_config.json, loaded by transformers
    got = m.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert got.shape[0] == 2 and torch.equal(got[:, :P], batch)
    assert _new_tokens(got, P, tok.eos_id) == ours
    for row, want in zip(got[:, P:].tolist(), ours):  # an EOS that ended a row is kept, then padding
        assert row[:len(want)] == want and (len(want) == NEW or row[len(want)] == tok.eos_id)
    # a GenerationConfig object, and the set sampler's threshold
    cfg = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=pad)
    thr, _ = _ours(run, ids, window=D, threshold=0.0005)
    out = m.generate(batch, attention_mask=mask, generation_config=cfg, threshold=0.0005, return_dict_in_generate=True)
    assert _new_tokens(out.sequences, P, tok.eos_id) == thr
    # sampling through top-k 1 or a tiny nucleus draws one token per position (its confidence 1, so the
    # leftmost is accepted): setdlm's sampler with the same settings; num_return_sequences repeats prompts
    for kw in ({"top_k": 1}, {"top_p": 1e-9, "top_k": 0}):
        want, _ = _ours(run, ids, window=D, threshold=None, temperature=0.7, **kw)
        s = m.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=0.7,
                       num_return_sequences=2, generator=torch.Generator().manual_seed(0), **kw)
        assert _new_tokens(s, P, tok.eos_id) == [want[0], want[0], want[1], want[1]], kw
    with pytest.raises(NotImplementedError, match="num_beams"):
        m.generate(batch, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="unsupported arguments"):
        m.generate(batch, max_new_tokens=2, no_such_option=1)


def test_an_ar_export_with_setdlm_code_generates_setdlms_greedy_tokens(tmp_path):
    from transformers import AutoModelForMaskedLM

    from pretrain.convert.export import export_checkpoint

    run = _run(tmp_path, "ar", ["objective.name=ar", "model.head_bias=true", "model.tie_embeddings=false"])  # not a stock shape
    export = export_checkpoint(run, tmp_path / "ar-hf", log=lambda s: None)
    assert json.loads((export / "config.json").read_text())["model_type"] == "setdlm"
    from data_pipeline.tokenizers import load_tokenizer

    tok = load_tokenizer("gpt2")
    prompts = [tok.encode(t) for t in ("The for statement", "A class is")]
    ours, _ = _ours(run, prompts)
    m = AutoModelForMaskedLM.from_pretrained(str(export), trust_remote_code=True).eval()
    got = [_new_tokens(m.generate(torch.tensor([p]), max_new_tokens=NEW), len(p), tok.eos_id)[0] for p in prompts]
    assert got == ours


def test_a_stock_ar_export_never_generates_mask(tmp_path):
    """The MASK row of the head is made 3x the row of the first greedy token, so MASK has the largest
    logit there: setdlm's logits give it -inf, the stock export's generation_config suppresses it, so
    transformers' greedy generate is setdlm's; without the suppression it would pick MASK."""
    from transformers import AutoModelForCausalLM

    from data_pipeline.tokenizers import load_tokenizer
    from pretrain.convert.export import export_checkpoint

    tok = load_tokenizer("gpt2")
    prompts = [tok.encode("The for statement"), tok.encode("A class is")]
    stock = ["objective.name=ar", "model.norm=rmsnorm", "model.activation=swiglu", "model.qk_norm=true",
             "model.bias=false", "model.tie_embeddings=false", "model.n_heads=2", "model.ffn_hidden=48"]
    first = _ours(_run(tmp_path, "base", stock), prompts[:1])[0][0][0]

    def mask_wins(state, cfg):
        state["head.weight"][cfg.model.mask_id] = 3 * state["head.weight"][first]

    run = _run(tmp_path, "stock", stock, edit=mask_wins)
    export = export_checkpoint(run, tmp_path / "stock-hf", log=lambda s: None)
    gen = json.loads((export / "generation_config.json").read_text())
    assert json.loads((export / "config.json").read_text())["model_type"] == "qwen3"
    assert gen["suppress_tokens"] == [tok.mask_id]
    ours, _ = _ours(run, prompts)
    m = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    with torch.no_grad():
        assert int(m(torch.tensor([prompts[0]])).logits[0, -1].argmax()) == tok.mask_id  # MASK would win
    got = [_new_tokens(m.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False), len(p), tok.eos_id)[0]
           for p in prompts]
    assert got == ours and ours[0][0] == first and all(tok.mask_id not in r for r in got)
