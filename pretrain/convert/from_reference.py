"""`setdlm convert from-reference`: a checkpoint of the reference implementation into a training run
directory: its Hugging Face releases with a pretrained Qwen3 backbone (the GSM8K and CNN/DM models;
model/convert/release.py) and its DiT checkpoints (Lightning, Composer, safetensors or a Hugging
Face-style directory; model/convert/reference.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from model import families
from model.convert.errors import ConvertError
from model.convert.hf_files import read_json, read_weights
from model.convert.hf_map import pad_rows

from ..checkpoint import rundir
from ..safe_load import CheckpointError
from .from_hf import run_config, write_run

__all__ = ["import_reference", "import_release", "reference_config"]


def reference_config(path: Path) -> dict:
    """config.json of a reference checkpoint directory ({} when it has none)."""
    if path.is_dir() and (path / "config.json").is_file():
        return read_json(path / "config.json", "model config")
    return {}


def _locate(path) -> Path:
    """--model: a directory or file, or a hub id found in the local Hugging Face cache."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    from model.convert.release import resolve_hub

    return resolve_hub(str(path), "the checkpoint", "--model")


def _release_weights(d: Path) -> dict:
    """The tensors of a release directory: safetensors, else pytorch_model.bin read as weights only."""
    from ..safe_load import load

    if (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file():
        return read_weights(d)
    f = d / "pytorch_model.bin"
    if not f.is_file():
        raise ConvertError(f"--model {d}: no weights (pytorch_model.bin or model.safetensors beside config.json)")
    try:
        state = load(f)
    except CheckpointError as e:
        raise ConvertError(f"--model {e}") from None
    if not isinstance(state, dict):
        raise ConvertError(f"--model {f}: not a state dict")
    return state


def import_release(d: Path, out, config: dict, *, family: str | None = None, set_size: int | None = None,
                   seq_len: int | None = None, tokenizer: str | None = None, base_model: str | None = None,
                   overrides=(), overwrite: bool = False, name: str | None = None, log=print) -> Path:
    """A release with a pretrained Qwen3 backbone (model/convert/release.py) into a run directory; `name`: what
    --model said (a hub id's name carries D: smax8), default the directory's name."""
    from data_pipeline.tokenizers import TokenizerError, load_tokenizer
    from model.convert import reference as ref
    from model.convert import release
    from model.convert.hf_map import from_hf_state_dict

    where = str(d / "config.json")
    family = family or ref.family_from_config(config)
    if family not in families.names():
        raise ConvertError(f"{where}: cannot tell the objective from architectures {config.get('architectures')} / "
                           f"model_type {config.get('model_type')!r}; pass --family {'|'.join(families.names())}")
    base_dir, base_config = release.resolve_base(config, base_model, where)  # before the weights are read
    state = _release_weights(d)
    hf, base_config = release.stock_state_dict(state, base_config, config.get("backbone_config") or {},
                                               f"--model {d}")
    del state
    try:
        tok = load_tokenizer(str(tokenizer or d))
    except TokenizerError as e:
        raise ConvertError(f"--tokenizer: {e}" if tokenizer else f"--model {d}: the release's tokenizer: {e} "
                           "(pass --tokenizer)") from None
    tc = config.get("tokenization_config") or {}
    want_mask = tc.get("mask_token_id", config.get("mask_token_id"))
    if want_mask is not None and int(want_mask) != tok.mask_id:
        raise ConvertError(f"--tokenizer {tok.name}: MASK id {tok.mask_id} differs from the release's "
                           f"tokenization_config.mask_token_id {want_mask}")
    rows = int(hf["model.embed_tokens.weight"].shape[0])
    if rows < tok.vocab_size:
        raise ConvertError(f"--tokenizer {tok.name}: {tok.vocab_size} tokens, more than the release's {rows} "
                           "embedding rows (tokenizer/model mismatch)")
    L = int(seq_len or config.get("length") or (config.get("noise_config") or {}).get("length") or 1024)
    obj = release.objective_section(family, config, name or d.name, where)
    if set_size:
        obj["set_size" if family == families.SETDLM.name else "block_size"] = int(set_size)
    raw = {"model": release.model_section(base_config, rows=rows, mask_id=tok.mask_id, length=L), "objective": obj,
           "data": {"tokenizer": str(rundir.tokenizer_dir(Path(out).resolve())), "seq_len": L}, "train": {"ema": 0.0}}
    cfg = run_config(raw, overrides)
    weights = from_hf_state_dict(hf, cfg.model, where=f"--model {d}")
    if rows > tok.vocab_size:
        log(f"setdlm convert: the release embeds {rows} rows for a {tok.vocab_size}-token tokenizer; all rows are "
            "kept as the vocabulary (the reference decodes over every row)")
    info = {"from": "reference-release", "path": str(d.resolve()), "family": family, "weights": "raw",
            "base_model_dir": str(base_dir), **release.describe_source(config)}
    return write_run(Path(out), cfg, weights, tok, info=info, overwrite=overwrite, log=log)


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
                     n_heads: int | None = None, tokenizer: str | None = None, base_model: str | None = None,
                     ema: bool = True, sigma: float = 0.0, overrides=(), overwrite: bool = False, log=print) -> Path:
    """`from-reference`: a checkpoint of the reference implementation into a training run directory."""
    from data_pipeline.tokenizers import load_tokenizer
    from model.convert import reference as ref
    from model.convert.release import is_release

    p = _locate(path)
    config = reference_config(p)
    if is_release(config):
        return import_release(p, out, config, family=family, set_size=set_size, seq_len=seq_len,
                              tokenizer=tokenizer, base_model=base_model, overrides=overrides, overwrite=overwrite,
                              name=Path(str(path)).name, log=log)
    if base_model and not (p.is_dir() and (p / "config.json").is_file()):
        raise ConvertError(f"--base-model: {p} has no config.json: a release with a pretrained backbone is read with "
                           "its config.json beside the weights (it names the base model and the schedule; copy it in), "
                           "and a DiT checkpoint takes no --base-model")
    if base_model:
        raise ConvertError("--base-model: only a release with a pretrained backbone (backbone_config "
                           f"AutoModelFromPreTrained) names a base model; {p}/config.json has no such backbone_config "
                           "(a DiT checkpoint: leave --base-model out)")
    tokenizer = tokenizer or "gpt2"
    obj, config = _read_reference(p)
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
    from model.convert.release import PREFIX

    if any(isinstance(k, str) and k.startswith(PREFIX) for k in obj):
        raise ConvertError(f"--model {p}: the weights are a release with a pretrained backbone ({PREFIX}*) but no "
                           "config.json is beside them (it names the base model and the schedule); copy it in")
    sd = ref.strip_prefixes(obj)
    used_ema = False
    if ema and shadow:
        sd, used_ema = ref.ema_state(sd, shadow), True
    bc = config.get("backbone_config") or {}
    arch = ref.describe(sd, n_heads or bc.get("n_heads"))
    family = family or ref.family_from_config(config) or ref.family_from_config({"model_type": p.name})
    if family not in families.names():
        raise ConvertError(f"--family: cannot tell the model's objective from the checkpoint; pass --family "
                           f"{'|'.join(families.names())}")
    tok = load_tokenizer(tokenizer)
    if arch["vocab"] < tok.vocab_size:
        raise ConvertError(f"--tokenizer {tokenizer}: its vocabulary ({tok.vocab_size} with MASK) is larger than the "
                           f"checkpoint's embedding ({arch['vocab']} rows)")
    want_mask = (config.get("tokenization_config") or {}).get("mask_token_id", config.get("mask_token_id"))
    if want_mask is not None and int(want_mask) != tok.mask_id:
        raise ConvertError(f"--tokenizer {tokenizer}: MASK id {tok.mask_id} differs from the checkpoint's {want_mask}")
    L = int(seq_len or bc.get("length") or config.get("max_length") or 1024)
    objective: dict = {"name": family}
    if family == families.SETDLM.name:
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
    elif family == families.BD3LM.name:
        nc = config.get("noise_config") if isinstance(config.get("noise_config"), dict) else {}
        objective["block_size"] = int(set_size or nc.get("block_size") or bc.get("block_size") or config.get("block_size") or 4)
    train_sd = ref.dit_to_training(sd, arch, sigma)
    V = tok.vocab_size
    if arch["vocab"] > V:
        log(f"setdlm convert: the checkpoint has {arch['vocab']} embedding rows for a {V}-token vocabulary; "
            "dropping the extra rows")
    dropout = bc.get("dropout", 0.1)  # the checkpoint's (backbone_config.dropout); the reference's default else
    try:
        dropout = float(dropout)
    except (TypeError, ValueError):
        raise ConvertError(f"--model {path}: backbone_config.dropout={dropout!r} is not a number") from None
    model_sec = ref.model_section(arch, V, tok.mask_id, L, dropout=dropout)
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


