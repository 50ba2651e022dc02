"""Release-format fixtures of the reference implementation's pretrained-backbone models, built here without
its code: a tiny stock `Qwen3ForCausalLM` from transformers is the backbone, its tensors are saved under the
release's keys (`backbone.model.model.*`, `backbone.model.lm_head.weight` sharing the embedding's storage
when tied, SetDLM's `static_attention_mask` buffer) in `pytorch_model.bin`, beside a `config.json` of the
denoiser as the reference saves it (backbone_config naming the base model by a hub id, noise_config,
tokenization_config), the GPT-2 tokenizer with the reference's MASK (`<|fim_middle|>`, appended as id
50257), and a copied .py file that must never run (it writes a marker file if imported)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HUB_BASE = "fixture-org/tiny-qwen3-base"  # a hub id that is in no cache
MASK = "<|fim_middle|>"
ROWS = 50304  # the base model's embedding rows (GPT-2's 50257 padded); the tokenizer has 50258 with MASK
ARCH = dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=256)
TRAP = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('release code ran')\n"


def base_model(d: Path, *, tie: bool = True, seed: int = 0) -> Path:
    """The base model: a random stock Qwen3 directory (config.json + safetensors)."""
    from model.convert.hf_testing import make_hf_model

    return make_hf_model(d, "qwen3", seed=seed, tie=tie, rows=ROWS, tokenizer=False, max_positions=4096, **ARCH)


def write_tokenizer(d: Path) -> None:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from model.convert.hf_testing import write_gpt2_tokenizer

    write_gpt2_tokenizer(d)
    tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(MASK, special=True, normalized=False)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
         "pad_token": "<|endoftext|>", "mask_token": MASK}))


FAMILY_CONFIG = {  # architectures, model_type, what the denoiser's config adds
    "setdlm": (["SetDLM"], "bd3lm"),
    "bd3lm": (["BD3LM"], "bd3lm"),
    "ar": (["AR"], "ar"),
    "mdlm": (["MDLM"], "mdlm"),
}


def release_config(family: str, length: int, *, base: str = HUB_BASE, num_layers: int = -1, keep_top: bool = False,
                   fht: bool = True, d: int = 4, block: int = 4) -> dict:
    archs, mtype = FAMILY_CONFIG[family]
    tc = {"vocab_size": 50258, "mask_token_id": 50257, "bos_token_id": 50256, "eos_token_id": 50256,
          "pad_token_id": 50256, "pad_vocab_size_multiple": 1}
    cfg = {"architectures": archs, "model_type": mtype, "attn_backend": "sdpa", "length": length,
           "auto_map": {"AutoConfig": "bd3lm.BD3LMConfig", "AutoModelForMaskedLM": "setdlm.SetDLM"},
           "backbone_config": {"_target_": "backbone_automodel.AutoModelFromPreTrained",
                               "automodel_cls": "AutoModelForCausalLM", "pretrained_model_name_or_path": base,
                               "num_layers": num_layers, "keep_top_layers": keep_top, "reinit_model": False,
                               "revision": None, "trust_remote_code": True, "attn_implementation": "sdpa",
                               "use_causal_mask": family == "ar"},
           "tokenization_config": tc, **tc, "tokenizer_name": "gpt2", "torch_dtype": "float32",
           "train_on_context": False, "transformers_version": "4.52.4", "noise_config": None}
    if family == "setdlm":
        cfg.update(block_size=length, eval_block_size=length, keep_clean_bos=None, setdlm_fht_cache_order=fht,
                   setdlm_eos_last_in_target_order=False,
                   noise_config={"_target_": "noise_schedule_noise_schedules.StaggeredNoise", "block_size": length,
                                 "desired_block_size": d, "eps": 0.001, "length": length, "max_block_size": 2 * d})
    elif family in ("bd3lm", "mdlm"):
        cfg.update(block_size=block if family == "bd3lm" else length, eval_block_size=block,
                   setdlm_fht_cache_order=False, setdlm_eos_last_in_target_order=False,
                   noise_config={"_target_": "noise_schedule_noise_schedules.LinearNoise", "block_size": block,
                                 "length": length})
    return cfg


def trained_backbone(base_dir: Path, seed: int = 1):
    """The base model with its weights moved (a 'fine-tuned' backbone): a transformers Qwen3ForCausalLM."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def write_release(d: Path, backbone, config: dict, *, layers: list[int] | None = None,
                  safetensors: bool = False) -> Path:
    """`backbone` (a transformers Qwen3ForCausalLM) saved as a release in `d`; `layers`: the base layers it
    keeps (the reference's truncation, renumbered from 0)."""
    d = Path(d)
    d.mkdir(parents=True)
    state = {}
    keep = layers if layers is not None else list(range(backbone.config.num_hidden_layers))
    # tied: lm_head.weight is the embedding's storage, which torch.save keeps shared
    for k, v in backbone.state_dict().items():
        if k.startswith("model.layers."):
            i = int(k.split(".")[2])
            if i not in keep:
                continue
            k = k.replace(f"model.layers.{i}.", f"model.layers.{keep.index(i)}.", 1)
        state["backbone.model." + k] = v
    if config["architectures"] == ["SetDLM"]:
        n = 2 * config["length"]
        state["static_attention_mask"] = torch.ones(n, n, dtype=torch.bool).tril()
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(d / "model.safetensors"))
    else:
        torch.save(state, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(d)
    for name in ("setdlm.py", "bd3lm.py", "backbone_automodel.py", "__init__.py"):
        (d / name).write_text(TRAP)
    return d


def two_stream_inputs(L: int, mask_id: int, seed: int = 3):
    """ids, positions [2, 2L] of the SetDLM two-stream layout (clean tokens in a permuted order, then MASKs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50257, (2, L), generator=g)
    perm = torch.stack([torch.randperm(L, generator=g) for _ in range(2)])
    clean = torch.gather(x, 1, perm)
    return torch.cat((clean, torch.full_like(clean, mask_id)), 1), torch.cat((perm, perm), 1)


def transformers_logits(backbone, ids, pos, mask: torch.Tensor) -> torch.Tensor:
    """transformers' own Qwen3 forward under a [T, T] bool mask (True: attend) with explicit positions."""
    add = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return backbone(input_ids=ids, position_ids=pos,
                        attention_mask=add[None, None].expand(ids.shape[0], 1, *mask.shape)).logits
