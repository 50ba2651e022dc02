"""Stock Hugging Face causal-LM directories (Qwen3, Llama, Mistral) read as our Transformer's weights.

Pure file and tensor code (no process groups, no recipes): `read_config` checks a directory and says
what is wrong with it, `model_section` derives the `model:` recipe fields from its config.json, and
`HFWeights` is a lazy mapping from our parameter names (tp=1 layout, model/transformer.py) to full
tensors, read one at a time from the safetensors files (never pickle) through the name map of
hf_map.py, so importing a large model under tensor parallelism holds one full tensor at a time
beside this rank's shard. Each point of the mapping is checked against `transformers`' own forward
in tests/test_hf_import.py.

The vocabulary is the tokenizer's: rows of the HF embedding/head beyond it (HF pads vocab_size) are
dropped, and a MASK token the tokenizer lacked gets a new row initialised to the mean of the
tokenizer's embedding rows (the head's MASK row too, though its logit is always -inf); rows added to
pad the vocabulary to `vocab_pad_multiple` are zero (their logits are -inf as well).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ..shapes import model_params
from .errors import ConvertError
from .hf_files import read_json, weight_files
from .hf_map import TOP, fuse, hf_names

__all__ = ["SUPPORTED", "ARCH_FIELDS", "read_config", "model_section", "embedding_rows", "HFWeights", "rope_theta"]

# model_type -> what it needs beyond the common Llama layout
SUPPORTED = {"qwen3": {"qk_norm": True}, "llama": {"qk_norm": False}, "mistral": {"qk_norm": False}}
# fields of `model:` taken from config.json (architecture); the others are training choices of the recipe
ARCH_FIELDS = ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "norm", "norm_eps",
               "activation", "qk_norm", "bias", "rope_base", "tie_embeddings", "head_bias")


def _need(config: dict, key: str, where: Path):
    if config.get(key) is None:
        raise ConvertError(f"{where}: config.json has no {key!r} (a Hugging Face causal-LM config needs it)")
    return config[key]


def read_config(d, need_weights: bool = True) -> dict:
    """config.json of a supported Hugging Face causal-LM directory, or a ConvertError saying why not
    (need_weights=False: the architecture only, e.g. a release's base model given by its config.json)."""
    d = Path(d)
    if not d.is_dir():
        raise ConvertError(f"{d}: no such directory (expected a Hugging Face model directory with config.json "
                           "and model.safetensors)")
    f = d / "config.json"
    if not f.is_file():
        raise ConvertError(f"{d}: no config.json; not a Hugging Face model directory")
    config = read_json(f, "the model's config")
    archs = config.get("architectures") or []
    mtype = config.get("model_type")
    if mtype == "setdlm":
        raise ConvertError(f"{d}: a setdlm export; start from it with `setdlm convert from-hf` (or point "
                           "train.init_from at the run directory it came from)")
    if archs and not any(str(a).endswith("ForCausalLM") for a in archs):
        raise ConvertError(f"{d}: architectures {archs} is not a causal language model (*ForCausalLM); "
                           f"init_from takes causal LMs of type {', '.join(SUPPORTED)}")
    if mtype not in SUPPORTED:
        raise ConvertError(f"{d}: model_type {mtype!r} is not supported; supported: {', '.join(SUPPORTED)}"
                           + (" (GPT-2 uses learned absolute positions, which this rotary transformer does not have)"
                              if mtype == "gpt2" else ""))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rtype not in (None, "default"):
        raise ConvertError(f"{f}: rope_type {rtype!r} (rotary scaling) is not supported; supported: default")
    if config.get("use_sliding_window") or (mtype == "mistral" and config.get("sliding_window")):
        raise ConvertError(f"{f}: sliding-window attention is not supported (use_sliding_window / sliding_window)")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ConvertError(f"{f}: layer_types {sorted(set(layer_types))}: only full_attention layers are supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"{f}: hidden_act {act!r} is not supported; supported: silu (SwiGLU)")
    if bool(config.get("attention_bias", False)) != bool(config.get("mlp_bias", config.get("attention_bias", False))):
        raise ConvertError(f"{f}: attention_bias={config.get('attention_bias')} with mlp_bias={config.get('mlp_bias')}: "
                           "this transformer has one bias switch for every linear layer (model.bias)")
    if need_weights:
        weight_files(d)
    return config


def rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_theta") is not None:
        return float(rope["rope_theta"])
    return float(config.get("rope_theta", 10000.0))


def model_section(config: dict, where="config.json") -> dict:
    """The `model:` architecture fields of a recipe, from a Hugging Face config.json."""
    heads = int(_need(config, "num_attention_heads", where))
    hidden = int(_need(config, "hidden_size", where))
    return {
        "n_layers": int(_need(config, "num_hidden_layers", where)), "hidden": hidden, "n_heads": heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "ffn_hidden": int(_need(config, "intermediate_size", where)), "norm": "rmsnorm",
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)), "activation": "swiglu",
        "qk_norm": SUPPORTED[config["model_type"]]["qk_norm"], "bias": bool(config.get("attention_bias", False)),
        "rope_base": rope_theta(config), "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "head_bias": False,
    }


def embedding_rows(config: dict) -> int:
    return int(config.get("vocab_size") or 0)


class HFWeights(Mapping):
    """Our tp=1 parameter name -> full float32 tensor, computed on access from the safetensors files.

    `cfg` is the resolved ModelConfig (vocabulary = the tokenizer's, MASK included); `n_real` is the
    number of tokenizer ids the HF embedding holds rows for (the tokenizer without a MASK it lacked)."""

    def __init__(self, d, cfg, n_real: int):
        from safetensors import safe_open

        self.dir, self.cfg, self.n_real = Path(d), cfg, int(n_real)
        self._where: dict[str, Path] = {}  # tensor -> file; a file is opened (mapped) only while a tensor is read
        self._rows = 0
        for f in weight_files(self.dir):
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        self._where[k] = f
                    if "model.embed_tokens.weight" in h.keys():
                        self._rows = h.get_slice("model.embed_tokens.weight").get_shape()[0]
            except Exception as e:  # noqa: BLE001 - safetensors raises several types
                raise ConvertError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        self._names = list(model_params(cfg))
        self._check()

    def _check(self) -> None:
        missing = [n for name in self._names for n in hf_names(name, self.cfg) if n not in self._where]
        extra = sorted(k for k in self._where if k.startswith("model.layers.")
                       and int(k.split(".")[2]) >= self.cfg.n_layers)
        if missing:
            raise ConvertError(f"{self.dir}: weights incomplete for config.json ({len(missing)} missing, first "
                               f"{missing[0]!r})")
        if extra:
            raise ConvertError(f"{self.dir}: weights hold more layers than config.json's num_hidden_layers "
                               f"(first extra: {extra[0]!r})")
        if self._rows < self.n_real:
            raise ConvertError(f"{self.dir}: the embedding has {self._rows} rows, fewer than the tokenizer's "
                               f"{self.n_real} tokens (tokenizer/model vocabulary mismatch)")

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name) -> bool:
        return name in self._names

    def _open(self, hf_name: str):
        from safetensors import safe_open

        return safe_open(str(self._where[hf_name]), framework="pt")

    def _get(self, hf_name: str) -> torch.Tensor:
        with self._open(hf_name) as h:
            return h.get_tensor(hf_name).float()

    def _vocab(self, hf_name: str) -> torch.Tensor:
        c = self.cfg
        with self._open(hf_name) as h:
            rows = h.get_slice(hf_name)[: self.n_real]  # only the tokenizer's rows are read
        out = torch.zeros(c.padded_vocab_size, rows.shape[1], dtype=torch.float32)
        out[: self.n_real] = rows  # cast in place: no full-size float32 intermediate
        del rows
        if c.mask_id >= self.n_real:  # a MASK the tokenizer lacked: the mean of the real rows
            out[c.mask_id] = out[: self.n_real].mean(0)
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        if name in ("embed.weight", "head.weight"):
            return self._vocab(f"{TOP[name.split('.')[0]]}.weight")
        return fuse(name, [self._get(n) for n in hf_names(name, self.cfg)], self.cfg)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, materialised (tests and small models)."""
        return {n: self[n] for n in self._names}
