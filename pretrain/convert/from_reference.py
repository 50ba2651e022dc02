"""`setdlm convert from-reference`: a checkpoint of the reference implementation (DiT backbone;
Lightning, Composer, safetensors or a Hugging Face-style directory) into a training run directory.
The tensor mapping is model/convert/reference.py."""

from __future__ import annotations

import sys
from pathlib import Path

from model.convert.errors import ConvertError
from model.convert.hf_files import read_json, read_weights
from model.convert.hf_map import pad_rows

from ..safe_load import CheckpointError
from .from_hf import run_config, write_run

__all__ = ["import_reference"]


def _read_reference(path: Path):
    """(state dict or Lightning checkpoint object, config.json or {}) of a reference checkpoint."""
    config: dict = {}
    if path.is_dir():
        if (path / "config.json").is_file():
            config = read_json(path / "config.json", "model config")
        for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
            if (path / name).is_file():
                return read_weights(path), config
        files = sorted([*path.glob("*.ckpt"), *path.glob("*.pt")])
        if not files:
            raise ConvertError(f"--model {path}: no weights (model.safetensors, pytorch_model.bin, *.ckpt or *.pt)")
        path = files[-1]
    if not path.is_file():
        raise ConvertError(f"--model {path}: no such file or directory")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path)), config
    from ..safe_load import load_foreign

    try:  # weights only: a Lightning/Composer checkpoint's tensors and plain values, never its pickled objects
        obj, skipped = load_foreign(path)
    except CheckpointError as e:
        raise ConvertError(f"--model {e}") from None
    if skipped:
        print(f"setdlm convert: {path}: {len(skipped)} pickled object type(s) were not loaded and nothing in them ran "
              f"({', '.join(skipped[:4])}{', ...' if len(skipped) > 4 else ''}); only tensors and plain values are read",
              file=sys.stderr)
    return obj, config


def import_reference(path, out, *, family: str | None = None, set_size: int | None = None, seq_len: int | None = None,
                     n_heads: int | None = None, tokenizer: str = "gpt2", ema: bool = True, sigma: float = 0.0,
                     overrides=(), overwrite: bool = False, log=print) -> Path:
    """`from-reference`: a reference-implementation DiT checkpoint into a training run directory."""
    from data_pipeline.tokenizers import load_tokenizer
    from model.convert import reference as ref

    obj, config = _read_reference(Path(path))
    shadow = None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):  # Lightning
        ema_state = obj.get("ema")
        shadow = ema_state.get("shadow_params") if isinstance(ema_state, dict) else None
        obj = obj["state_dict"]
    elif isinstance(obj, dict) and isinstance(obj.get("state"), dict) and isinstance(obj["state"].get("model"), dict):
        obj = obj["state"]["model"]  # Composer
    if not isinstance(obj, dict):
        raise ConvertError(f"--model {path}: not a state dict")
    from ..safe_load import inert_entries

    bad = inert_entries({"weights": obj, "ema": shadow})
    if bad:
        raise ConvertError(f"--model {path}: refused: the weights hold pickled objects that are not tensors "
                           f"({'; '.join(bad)}); setdlm never runs code from a checkpoint")
    sd = ref.strip_prefixes(obj)
    used_ema = False
    if ema and shadow:
        sd, used_ema = ref.ema_state(sd, shadow), True
    bc = config.get("backbone_config") or {}
    arch = ref.describe(sd, n_heads or bc.get("n_heads"))
    family = family or ref.family_from_config(config)
    if family not in ("setdlm", "bd3lm", "mdlm", "ar"):
        raise ConvertError("--family: cannot tell the model's objective from the checkpoint; pass --family "
                           "setdlm|bd3lm|mdlm|ar")
    tok = load_tokenizer(tokenizer)
    if arch["vocab"] < tok.vocab_size:
        raise ConvertError(f"--tokenizer {tokenizer}: its vocabulary ({tok.vocab_size} with MASK) is larger than the "
                           f"checkpoint's embedding ({arch['vocab']} rows)")
    want_mask = (config.get("tokenization_config") or {}).get("mask_token_id", config.get("mask_token_id"))
    if want_mask is not None and int(want_mask) != tok.mask_id:
        raise ConvertError(f"--tokenizer {tokenizer}: MASK id {tok.mask_id} differs from the checkpoint's {want_mask}")
    L = int(seq_len or bc.get("length") or config.get("max_length") or 1024)
    objective: dict = {"name": family}
    if family == "setdlm":
        recorded = ref.schedule_from_config(config, L)  # noise_config.desired_block_size / max_block_size / k
        if set_size and recorded.get("set_size") not in (None, int(set_size)):
            log(f"setdlm convert: --set-size {set_size} overrides the checkpoint's desired_block_size "
                f"{recorded['set_size']}")
        if set_size:
            recorded["set_size"] = int(set_size)
        if not recorded.get("set_size"):
            raise ConvertError("--set-size: the SetDLM set size D is not recorded in the checkpoint (no "
                               "noise_config.desired_block_size in its config.json); pass it (the reference's "
                               "model names carry it: owt-setdlm-d4 is D=4; smax8 is D=4)")
        objective.update(recorded)  # S_max = 2 D and k from the budget unless recorded (SETDLM.md section 2)
    elif family == "bd3lm":
        nc = config.get("noise_config") if isinstance(config.get("noise_config"), dict) else {}
        objective["block_size"] = int(set_size or nc.get("block_size") or bc.get("block_size") or config.get("block_size") or 4)
    train_sd = ref.dit_to_training(sd, arch, sigma)
    V = tok.vocab_size
    if arch["vocab"] > V:
        log(f"setdlm convert: the checkpoint has {arch['vocab']} embedding rows for a {V}-token vocabulary; "
            "dropping the extra rows")
    model_sec = ref.model_section(arch, V, tok.mask_id, L)
    raw = {"model": model_sec, "objective": objective,
           "data": {"tokenizer": tokenizer, "seq_len": L}, "train": {"ema": 0.0}}
    cfg = run_config(raw, overrides)
    Vp = cfg.model.padded_vocab_size
    for k in ("embed.weight", "head.weight", "head.bias"):
        train_sd[k] = pad_rows(train_sd[k][:V], Vp)
    if arch["adaln"]:
        log(f"setdlm convert: time conditioning (adaLN) folded at sigma={sigma}: exact for models trained without "
            "time conditioning (the reference's default)")
    info = {"from": "reference", "path": str(Path(path).resolve()), "family": family, "adaln_sigma": sigma if arch["adaln"] else None,
            "weights": "ema" if used_ema else "raw"}
    return write_run(Path(out), cfg, train_sd, tok, info=info, overwrite=overwrite, log=log)


