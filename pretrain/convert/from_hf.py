"""`setdlm convert from-hf`: an export back into a training run directory; `write_run`, the one writer
of a run directory holding imported weights (also used by `from-reference`)."""

from __future__ import annotations

from pathlib import Path

import torch

from model.convert.errors import ConvertError
from model.convert.hf_config import RECIPE_FILE, configs_from_hf, migrate_export
from model.convert.hf_files import read_json, read_weights
from model.convert.hf_map import from_hf_state_dict
from model.convert.hf_stock_export import STOCK_CLASSES

from ..checkpoint import rundir
from ..safe_load import CheckpointError
from .staging import staging, tensor_bytes

__all__ = ["write_run", "run_config", "import_hf"]


def _normalize_weights(cfg, weights: dict) -> dict:
    """`weights` loaded into a tp=1 Transformer of `cfg` (checking names and shapes): its state dict."""
    from ..checkpoint.inference import model_with_weights

    weights = {k: v.float() for k, v in weights.items() if torch.is_tensor(v)}
    try:
        return model_with_weights(cfg.model, weights, "weights").state_dict()
    except CheckpointError as e:
        raise ConvertError(str(e)) from None


def write_run(out: Path, cfg, weights: dict, tokenizer, *, info: dict, overwrite: bool = False, log=print) -> Path:
    """A run directory holding one checkpoint (step 0) with `weights` as a consolidated state dict
    (pretrain/checkpoint/consolidate.py format): `load_model` reads it, and `setdlm pretrain --config
    RUN/config.yaml` continues from it under any TP/PP/DP layout and ZeRO stage (the re-layout path of
    pretrain/checkpoint/resume.py: fresh AdamW moments, LR schedule from step 0, data from the beginning)."""
    from ..checkpoint.rng import rng_state
    from ..config import save_config

    out = Path(out).resolve()
    cfg.run.out_dir, cfg.run.name = str(out.parent), out.name
    cfg.model.validate()
    cfg.objective.validate(cfg.data.seq_len)
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConvertError(f"data.seq_len: {cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    state = _normalize_weights(cfg, weights)
    # No layout can equal this one, so the trainer always takes the consolidated (re-layout) path.
    layout = {"world": None, "tp": 1, "pp": 1, "dp": None, "zero_stage": None, "imported": True}
    meta = {"step": 0, "tokens_seen": 0, "wandb_id": None, "layout": layout, "tokenizer": tokenizer.name,
            "tokenizer_sha256": tokenizer.sha256, "objective": cfg.objective.name, "config": cfg.to_dict(),
            "imported": info}
    with staging(out, overwrite, "run directory", need=tensor_bytes(state)) as tmp:
        save_config(cfg, tmp / "config.yaml")
        tokenizer.save(rundir.tokenizer_dir(tmp))
        root = rundir.checkpoints_dir(tmp)
        ck = root / rundir.tag_for(0)
        ck.mkdir(parents=True)
        torch.save({"module": state, "ema": None, "optimizer": None,
                    "meta": {"step": 0, "tokens_seen": 0, "layout": layout, "source": info.get("path")}},
                   ck / rundir.CONSOLIDATED)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.run.seed)
            torch.save({"rng": rng_state(), "step": 0}, rundir.extra_file(ck, 0))
        rundir.write_meta(ck, meta)
        rundir.mark_complete(ck)
        rundir.point_latest(root, ck.name)
    log(f"setdlm convert: wrote run {out} (load_model reads it; continue training with "
        f"setdlm pretrain --config {out / 'config.yaml'} [overrides])")
    return out


def run_config(raw: dict, overrides):
    from ..config import _merge, from_dict, parse_overrides

    raw = _merge(raw, parse_overrides(list(overrides)))
    try:
        return from_dict(raw)
    except ValueError as e:
        raise ConvertError(str(e)) from None


def import_hf(model_dir, out, *, overrides=(), overwrite: bool = False, log=print) -> Path:
    """`from-hf`: an export directory back into a training run directory."""
    from data_pipeline.tokenizers import BUILTIN, TokenizerError, load_tokenizer

    d = Path(model_dir)
    if not d.is_dir():
        raise ConvertError(f"--model {d}: no such directory")
    config = read_json(d / "config.json", "not a Hugging Face model directory")
    if config.get("model_type") in STOCK_CLASSES:
        raise ConvertError(f"{d / 'config.json'}: model_type is {config.get('model_type')!r}, not 'setdlm': a stock model "
                           f"(an AR export or a hub model); continue from it with train.init_from={d}")
    if config.get("model_type") != "setdlm":
        from model.convert.reference import family_from_config

        if config.get("backbone_config") is not None and family_from_config(config):
            raise ConvertError(f"{d / 'config.json'}: a checkpoint of the reference implementation (architectures "
                               f"{config.get('architectures')}, model_type {config.get('model_type')!r}); import it with "
                               f"`setdlm convert from-reference --model {d} --out {out}`")
        raise ConvertError(f"{d / 'config.json'}: model_type is {config.get('model_type')!r}, not 'setdlm'; for the "
                           "reference implementation's checkpoints use `setdlm convert from-reference`")
    config = migrate_export(config, "setdlm_format_version", d / "config.json")
    model_sec, obj_sec, seq_len = configs_from_hf(config)
    recipe_file = d / RECIPE_FILE
    saved = migrate_export(read_json(recipe_file, "recipe"), "format_version", recipe_file) if recipe_file.is_file() else {}
    raw = {k: dict(v) for k, v in (saved.get("recipe") or {}).items() if isinstance(v, dict)}
    raw["model"] = {**model_sec, "preset": None}
    if raw.get("objective", {}).get("name") != obj_sec["name"]:
        raw["objective"] = obj_sec
    raw.setdefault("data", {})["seq_len"] = seq_len
    if not (d / "tokenizer.json").is_file():
        raise ConvertError(f"{d}: tokenizer.json is missing (incomplete export: the tokenizer files are needed)")
    cfg = run_config(raw, overrides)
    hf = read_weights(d)
    weights = from_hf_state_dict({k: v.float() for k, v in hf.items()}, cfg.model, where=str(d))
    try:
        tokenizer = load_tokenizer(str(d.resolve()))
    except TokenizerError as e:
        raise ConvertError(f"{d}: the tokenizer cannot be loaded ({e})") from None
    if tokenizer.vocab_size != model_sec["vocab_size"] or tokenizer.mask_id != model_sec["mask_id"]:
        raise ConvertError(f"{d}: the tokenizer (vocabulary {tokenizer.vocab_size}, MASK {tokenizer.mask_id}) does not "
                           f"match config.json (vocab_size {model_sec['vocab_size']}, mask_token_id {model_sec['mask_id']})")
    name, same = cfg.data.tokenizer, False
    if name in BUILTIN or Path(name).is_dir():  # never a hub lookup here
        try:
            same = load_tokenizer(name).sha256 == tokenizer.sha256
        except Exception:  # noqa: BLE001 - a name that does not resolve here: use the run's copy
            same = False
    if not same:
        cfg.data.tokenizer = str(rundir.tokenizer_dir(Path(out).resolve()))
    info = {"from": "hf", "path": str(d.resolve()), "source_step": saved.get("step"), "weights": saved.get("weights")}
    return write_run(Path(out), cfg, weights, tokenizer, info=info, overwrite=overwrite, log=log)


