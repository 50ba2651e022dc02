"""The reference implementation's Hugging Face releases with a pretrained-transformer backbone (the
paper's GSM8K and CNN/DM models: kuleshov-group/setdlm-gsm8k-smax8/16/32, gsm8k-ar, gsm8k-bd3lm-s*,
cnndm-*), read as a stock Qwen3 state dict and the recipe sections of an imported run.

What such a release holds, as the reference's `save_pretrained_or_push_to_hub` writes it (read from
its source, kuleshov-group/setdlms `src/utils.py`, `src/denoiser/*.py`, `src/backbone/automodel.py`):

- `config.json` of its denoiser: `architectures` ["SetDLM"] / ["BD3LM"] / ["MDLM"] / ["AR"],
  `model_type` bd3lm / mdlm / ar (a SetDLM config is a BD3LMConfig), `length` L, `block_size`,
  `backbone_config` (`_target_` ...AutoModelFromPreTrained, `pretrained_model_name_or_path` of the base
  model, `num_layers` (-1: all), `keep_top_layers`, `reinit_model`: no shapes), `noise_config`
  (SetDLM: StaggeredNoise `desired_block_size` D, `max_block_size`, `block_size`, `length`),
  `tokenization_config` (vocab_size, mask/bos/eos/pad ids), `setdlm_fht_cache_order`,
  `setdlm_eos_last_in_target_order` (training only: it moves target EOS last in the sampled orders);
- `pytorch_model.bin` (saved with safe_serialization=False): `backbone.model.model.*` and
  `backbone.model.lm_head.weight` (the same storage as the embedding when the base ties them) of a
  Qwen3 causal LM, plus SetDLM's `static_attention_mask` buffer (ignored here);
- the tokenizer files, and copies of the reference's .py files (never imported or run here).

The backbone is Qwen3's decoder run with a dense mask and explicit position ids (its custom attention
only adds an unused query offset), so the tensors are a stock Qwen3 checkpoint: `stock_state_dict`
re-keys them and the name map of hf_map.py does the rest. The shapes come from the base model's
config.json; the layers are those the release holds (the reference keeps the first `num_layers`, or
the top ones with `keep_top_layers`, renumbered from 0, so the file has exactly that many).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .errors import ConvertError
from .hf_stock import model_section as stock_model_section

__all__ = ["is_release", "base_model_name", "resolve_hub", "resolve_base", "effective_base", "stock_state_dict",
           "model_section", "objective_section", "set_size_from_name", "describe_source", "PREFIX", "HEAD"]

PREFIX = "backbone.model."  # AutoModelFromPreTrained.model (a Qwen3ForCausalLM) inside the denoiser
HEAD = "lm_head.weight"
BACKBONE_CLASS = "AutoModelFromPreTrained"


def is_release(config: dict) -> bool:
    """A release of the reference whose backbone is a pretrained transformer (not its DiT)."""
    bc = config.get("backbone_config")
    return isinstance(bc, dict) and str(bc.get("_target_", "")).endswith(BACKBONE_CLASS)


def base_model_name(config: dict, where) -> str:
    bc = config.get("backbone_config") or {}
    name = bc.get("pretrained_model_name_or_path")
    if not isinstance(name, str) or not name:
        raise ConvertError(f"{where}: backbone_config names no base model (pretrained_model_name_or_path); pass "
                           "--base-model DIR with the base model's config.json")
    return name


def resolve_hub(name: str, what: str, flag: str) -> Path:
    """A local directory, or a Hugging Face hub id found in the local Hugging Face cache (nothing is
    downloaded); a one-line ConvertError saying what to pass otherwise."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p.resolve()
    if p.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ConvertError(f"{flag} {name}: no such directory (expected a local directory or a Hugging Face hub id "
                           f"org/name in the local Hugging Face cache)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or no hub library): say what to do
        raise ConvertError(f"{flag} {name}: {what} is a Hugging Face hub id that is not in the local Hugging Face "
                           f"cache, and nothing is downloaded here; pass {flag} DIR with a directory holding it "
                           "(or download it into the cache first)") from None


def resolve_base(config: dict, override: str | None, where) -> tuple[Path, dict]:
    """(directory, config.json) of the base model whose shapes the release uses: `override`
    (--base-model) or the release's backbone_config.pretrained_model_name_or_path."""
    name = override or base_model_name(config, where)
    try:
        d = resolve_hub(str(name), "the base model", "--base-model")
    except ConvertError as e:
        if override:
            raise
        raise ConvertError(f"{where}: backbone_config.pretrained_model_name_or_path {name!r} is not a local directory "
                           "nor in the local Hugging Face cache (nothing is downloaded here); pass --base-model DIR "
                           "with a directory holding that model's config.json") from e
    if not (d / "config.json").is_file():
        raise ConvertError(f"--base-model {d}: no config.json (the base model's config.json gives the shapes)")
    from .hf_stock import read_config

    return d, read_config(d, need_weights=False)


def set_size_from_name(name: str) -> int | None:
    """D from a release's name as the reference's loader reads it: `d4` / `tgt4` give D = 4, `smax8` gives
    S_max = 8, D = 4."""
    key = str(name).lower()
    for pattern in (r"(?:^|[^a-z0-9])d(\d+)(?:$|[^a-z0-9])", r"(?:^|[^a-z0-9])tgt(\d+)(?:$|[^a-z0-9])"):
        m = re.search(pattern, key)
        if m:
            return int(m.group(1))
    m = re.search(r"(?:^|[^a-z0-9])smax(\d+)(?:$|[^a-z0-9])", key)
    return int(m.group(1)) // 2 if m else None


# AutoModelFromPreTrained's own arguments; every other backbone_config key is passed on to the base model's
# config (AutoConfig.from_pretrained(name, **kwargs)); the CNN/DM releases set hidden_size and intermediate_size
LOADER_KEYS = ("_target_", "automodel_cls", "pretrained_model_name_or_path", "trust_remote_code", "num_layers",
               "keep_top_layers", "reinit_model", "use_causal_mask", "revision", "attn_implementation", "torch_dtype",
               "dtype")


def effective_base(base_config: dict, backbone_config: dict) -> dict:
    """The base config as the reference builds the backbone from it: backbone_config's extra keys override it."""
    return {**base_config, **{k: v for k, v in backbone_config.items() if k not in LOADER_KEYS}}


def _layer_count(keys) -> int:
    idx = sorted({int(m.group(1)) for k in keys for m in [re.match(r"model\.layers\.(\d+)\.", k)] if m})
    if idx != list(range(len(idx))):
        raise ConvertError(f"release weights: layer indices {idx[:6]} are not 0..N-1")
    return len(idx)


def stock_state_dict(state: dict, base_config: dict, backbone_config: dict, where) -> tuple[dict, dict]:
    """(Qwen3 tensors named as in a stock directory, the base config.json as the release's backbone has it:
    backbone_config's overrides applied, truncated to its layers) from a release's state dict. Checks the
    layer count against `num_layers` and the head against the base model's `tie_word_embeddings`."""
    base_config = effective_base(base_config, backbone_config)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not torch.is_tensor(value) or not key.startswith(PREFIX) or key.endswith("rotary_emb.inv_freq"):
            continue  # static_attention_mask and other denoiser buffers; rotary tables are recomputed
        out[key[len(PREFIX):]] = value
    if "model.embed_tokens.weight" not in out:
        raise ConvertError(f"{where}: no {PREFIX}model.embed_tokens.weight: not a release of the reference's "
                           "pretrained-backbone models")
    n = _layer_count(out)
    want = int(backbone_config.get("num_layers", -1) or -1)
    full = int(base_config.get("num_hidden_layers") or 0)
    if want == -1:
        expect = full
    elif backbone_config.get("reinit_model"):  # built from the base config with num_hidden_layers=num_layers
        expect = want
    else:  # the first (or, keep_top_layers, the last) num_layers of the base model, renumbered from 0
        expect = min(want, full)
    if n != expect:
        raise ConvertError(f"{where}: the weights hold {n} layers, but backbone_config.num_layers={want} of the base "
                           f"model's {full} gives {expect}: the base model is not the one this release was trained "
                           "from (pass --base-model)")
    tied = bool(base_config.get("tie_word_embeddings", False))
    emb = out["model.embed_tokens.weight"]
    head = out.get(HEAD)
    if head is None:
        if not tied:
            raise ConvertError(f"{where}: no {PREFIX}{HEAD} but the base model's config.json has tie_word_embeddings="
                               "false (an untied head must be saved): tied/untied mismatch with the base model")
    elif not tied and head.shape == emb.shape and torch.equal(head, emb):
        raise ConvertError(f"{where}: {PREFIX}{HEAD} is the embedding (a tied head) but the base model's config.json "
                           "has tie_word_embeddings=false: tied/untied mismatch with the base model (pass --base-model "
                           "with the model it was trained from)")
    elif tied and (head.shape != emb.shape or not torch.equal(head, emb)):
        raise ConvertError(f"{where}: {PREFIX}{HEAD} differs from the embedding but the base model's config.json has "
                           "tie_word_embeddings=true: tied/untied mismatch with the base model (pass --base-model "
                           "with the model it was trained from)")
    if tied:
        out.pop(HEAD, None)
    base = dict(base_config, num_hidden_layers=n)
    if isinstance(base.get("layer_types"), list):
        base["layer_types"] = base["layer_types"][:n]
    return {k: v.float() for k, v in out.items()}, base


def model_section(base_config: dict, *, rows: int, mask_id: int, length: int) -> dict:
    """The recipe's `model:` section: the base model's shapes, its dropout, the release's rows and length."""
    sec = stock_model_section(base_config)
    sec.update(vocab_size=int(rows), mask_id=int(mask_id), max_seq_len=int(length),
               dropout=0.0, attention_dropout=float(base_config.get("attention_dropout", 0.0) or 0.0))
    return sec


def _pos_int(v, name, where):
    from .reference import positive

    return positive(v, name, where)


def objective_section(family: str, config: dict, name: str, where) -> dict:
    """The recipe's `objective:` section of a release: SetDLM's D (noise_config.desired_block_size, else
    the release's name), S_max when it is not 2D, its decoding cache order; BD3-LM's block size."""
    from .. import families
    from .reference import schedule_from_config

    obj: dict = {"name": family}
    length = int(config.get("length") or 0)
    if family == families.SETDLM.name:
        rec = schedule_from_config(config, length)
        if "set_size" not in rec:
            d = set_size_from_name(name)
            if d is None:
                raise ConvertError(f"{where}: the SetDLM set size D is recorded neither in noise_config."
                                   "desired_block_size nor in the name (smaxN / dN); pass --set-size")
            rec["set_size"] = d
        obj.update(rec)
        obj["cache_order"] = "first_hitting" if config.get("setdlm_fht_cache_order") else "position"
    elif family == families.BD3LM.name:
        obj["block_size"] = _pos_int(config.get("block_size") or config.get("eval_block_size") or 4,
                                     "block_size", where)
    return obj


def describe_source(config: dict) -> dict:
    """What the run records about the release (meta.json `imported`)."""
    bc = config.get("backbone_config") or {}
    return {"base_model": bc.get("pretrained_model_name_or_path"), "num_layers": bc.get("num_layers"),
            "keep_top_layers": bool(bc.get("keep_top_layers", False)), "fht_cache_order":
            bool(config.get("setdlm_fht_cache_order", False)),
            "eos_last_in_target_order": bool(config.get("setdlm_eos_last_in_target_order", False))}

