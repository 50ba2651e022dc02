"""`setdlm convert`: training checkpoints to and from Hugging Face exports, and the importer for the
reference implementation's DiT checkpoints (docs/convert.md).

    setdlm convert to-hf --checkpoint RUN_OR_CKPT --out DIR [--ema/--no-ema] [--dtype fp32|bf16]
                         [--max-shard-size 5GB] [--results FILE ...] [--overwrite]
                         [--format auto|stock|setdlm] [--adapter-only | --base-only]
    setdlm convert from-hf --model DIR --out RUN_DIR [--overwrite] [section.key=value ...]
    setdlm convert from-reference --model PATH --out RUN_DIR [--family F] [--set-size D] [--seq-len L]
                         [--n-heads N] [--tokenizer gpt2] [--ema/--no-ema] [--sigma 0] [section.key=value ...]
    setdlm convert consolidate ...      (sharded TP/PP/ZeRO-3 checkpoints; pretrain/checkpoint/consolidate.py)

The weight mapping itself is pure tensor code in model/convert/; this module reads and writes run
directories through the checkpoint file layer (pretrain/checkpoint/rundir.py). An AR model whose shape
is a stock architecture (Qwen3, Llama, Mistral) exports as that architecture (`--format auto`, the
default; model/convert/hf_stock_export.py), every other model with setdlm's modeling code. A LoRA run
(`train.lora`) exports with its adapters merged; `--adapter-only` writes them as a PEFT adapter
(pretrain/hf_adapter.py) and `--base-only` the frozen base model it loads onto.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from common.cli import ArgumentParser as CLIParser
from common.errors import StorageError
from common.io import HOST, process_alive
from common.jsonl import read_jsonl
from common.storage import check_output_dir, write_failure

from model.convert.card import render_card, render_stock_card
from model.convert.errors import ConvertError
from model.convert.hf_config import CODE_FILES, HF_CODE_DIR, RECIPE_FILE, configs_from_hf, hf_config
from model.convert.hf_files import DTYPES, cast, parameter_total, parse_size, read_json, read_weights, write_weights
from model.convert.hf_map import from_hf_state_dict, pad_rows, to_hf_state_dict
from model.convert.hf_stock_export import FORMATS, STOCK_CLASSES, export_type, stock_config
from model.convert.hf_stock_export import generation_config as stock_generation

from .checkpoint import rundir
from .safe_load import CheckpointError

EXPORT_SUBDIR = "hf"  # train.export_hf writes RUN/hf


# -- reading training checkpoints ------------------------------------------------------------------
def read_checkpoint(path, *, ema: bool = True, merge_lora: bool = True):
    """(checkpoint dir, meta, RecipeConfig, tp=1 weights, whether EMA weights were used); LoRA adapters
    merged into the weights unless `merge_lora=False`."""
    from .checkpoint.inference import checkpoint_weights

    ckpt = rundir.resolve_checkpoint(path)
    meta = rundir.read_meta(ckpt)
    cfg = rundir.read_recipe(ckpt, meta)
    weights, used_ema = checkpoint_weights(ckpt, meta, ema=ema, merge_lora=merge_lora)  # any layout; weights-only
    return ckpt, meta, cfg, weights, used_ema


def collect_results(run_dir: Path, step: int, files=()) -> list[tuple[str, object]]:
    """Evaluation results for the model card: the validation metrics logged at (or before) `step` in
    metrics.jsonl, and scalar fields of metrics JSON files (given, and RUN/eval/**/metrics*.json)."""
    rows: list[tuple[str, object]] = []
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file():
        last = None
        for row in read_jsonl(metrics, skip_bad=True):  # a row cut short by a kill is skipped
            if row.get("val/nll") is not None and row.get("step", 0) <= step:
                last = row
        if last is not None:
            s = last["step"]
            rows += [(f"validation NLL bound (nats/token, step {s})", last["val/nll"]),
                     (f"validation bits per token (step {s})", last.get("val/bpt")),
                     (f"validation perplexity bound (step {s})", last.get("val/ppl"))]
            if last.get("val/tokens"):
                rows.append((f"validation tokens (step {s})", int(last["val/tokens"])))
    found = [Path(f) for f in files]
    eval_dir = Path(run_dir) / "eval"
    if eval_dir.is_dir():
        found += sorted(eval_dir.rglob("metrics*.json"))
    for f in found:
        data = read_json(f, "evaluation results")
        flat: list[tuple[str, object]] = []

        def walk(prefix, v):
            if isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}/{k}" if prefix else str(k), x)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                flat.append((f"{f.stem}: {prefix}", v))

        walk("", data)
        rows += flat[:40]
    return rows


# -- writing ---------------------------------------------------------------------------------------
def _tensor_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if torch.is_tensor(t))


@contextmanager
def staging(out: Path, overwrite: bool, what: str, need: int | None = None):
    """Write into a temporary sibling and rename it to `out` at the end (never a half-written `out`).
    A failed write (a full disk: `need` bytes is about what it takes) removes the partial directory,
    keeps an existing `out` and is one StorageError naming the path and the space."""
    out = Path(out)
    check_output_dir(out, "--out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConvertError(f"--out {out}: already exists and is not empty; choose another {what} or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*out.parent.glob(f".{out.name}.tmp-{HOST}-*"), *out.parent.glob(f".{out.name}.old-{HOST}-*")]:
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{HOST}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = write_failure(e, out, need) if isinstance(e, Exception) else None
        if failure is not None:
            kept = f"; {out} is kept as it was" if out.exists() else ""
            raise StorageError(f"{failure}; the partial {what} was removed{kept}") from None
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{HOST}-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


LORA_EXPORTS = ("merge", "adapter", "base")


def export_checkpoint(checkpoint, out, *, ema: bool = True, dtype: str = "fp32", max_shard_size="5GB",
                      results=(), overwrite: bool = False, log=print, fmt: str = "auto", lora: str = "merge") -> Path:
    """`to-hf`: write a Hugging Face export of a training checkpoint to `out`: stock architecture or
    setdlm code (`fmt`, see `export_type`); a LoRA run's adapters merged, or (`lora`) as a PEFT adapter
    alone ("adapter") or left out ("base": the frozen base model the adapter loads onto)."""
    import transformers

    if dtype not in DTYPES:
        raise ConvertError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if lora not in LORA_EXPORTS:
        raise ConvertError(f"lora: {lora!r} is not one of {', '.join(LORA_EXPORTS)}")
    shard_bytes = parse_size(max_shard_size)
    ckpt, meta, cfg, weights, used_ema = read_checkpoint(checkpoint, ema=ema, merge_lora=lora == "merge")
    tokenizer = rundir.checkpoint_tokenizer(ckpt, meta, cfg.data.tokenizer)
    mtype = export_type(cfg, fmt)
    if lora != "merge":
        from .hf_adapter import adapter_files, split_adapters, write_adapter_files

        flag = "--adapter-only" if lora == "adapter" else "--base-only"
        weights, adapters = split_adapters(weights, cfg, ckpt, flag)
        if lora == "adapter":  # a PEFT adapter directory (pretrain/hf_adapter.py)
            files = adapter_files(adapters, cfg, name=Path(out).name, meta=meta, used_ema=used_ema, model_type=mtype)
            with staging(Path(out), overwrite, "output directory") as tmp:
                write_adapter_files(files, tmp)
                tokenizer.save(tmp)
            n = sum(t.numel() for t in files["tensors"].values())
            log(f"setdlm convert: wrote the PEFT adapter {out} ({n:,} parameters, rank {cfg.train.lora.rank} on "
                f"{', '.join(files['targets'])}) of {ckpt}; load it onto the --base-only export")
            return Path(out)
    hf = cast(to_hf_state_dict(weights, cfg.model), dtype)
    config = hf_config(cfg.model, cfg.objective, cfg.data.seq_len, tokenizer_meta=tokenizer.meta(), dtype=dtype,
                       extra={"transformers_version": transformers.__version__})
    step = int(meta.get("step", 0))
    recipe = {"format_version": config["setdlm_format_version"], "recipe": cfg.to_dict(), "step": step,
              "tokens_seen": meta.get("tokens_seen"), "weights": "ema" if used_ema else "raw",
              "source_checkpoint": str(ckpt), "layout": meta.get("layout"), "tokenizer_sha256": tokenizer.sha256}
    sd = config["set_diffusion"]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"], "mask_token_id": config["mask_token_id"],
                  "do_sample": False, "max_new_tokens": 128,
                  "set_diffusion": {"family": sd["family"], "window": sd.get("set_size") if sd["family"] == "setdlm" else 1,
                                    "confidence_threshold": None, "block_size": sd.get("block_size")},
                  "transformers_version": transformers.__version__}
    training = {"steps trained": step, "tokens seen": meta.get("tokens_seen"),
                "exported weights": ("EMA" if used_ema else "raw (no EMA)") + (
                    "; LoRA adapters merged" if cfg.train.lora and lora == "merge" else
                    "; the frozen base (LoRA adapters left out)" if lora == "base" else "")}
    res = collect_results(rundir.run_of(ckpt), step, results)
    name = Path(out).name or "setdlm-model"
    code = CODE_FILES
    if mtype is not None:  # a stock architecture: its own config, greedy generation, no custom code
        stock = stock_config(cfg.model, mtype, tokenizer_meta=tokenizer.meta(), dtype=dtype)
        config, generation, code = stock.to_dict(), stock_generation(tokenizer.meta()), ()
        recipe["export"] = {"model_type": mtype}
        card = render_stock_card(config, name=name, recipe=cfg.to_dict(), training=training, results=res,
                                 params=parameter_total(hf), source=f"{cfg.run.name} step {step}")
    else:
        card = render_card(config, name=name, recipe=cfg.to_dict(), training=training, results=res,
                           params=parameter_total(hf), source=f"{cfg.run.name} step {step}")
    with staging(Path(out), overwrite, "output directory", need=_tensor_bytes(hf)) as tmp:
        files = write_weights(hf, tmp, shard_bytes)
        if mtype is not None:
            stock.save_pretrained(str(tmp))
        else:
            _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / RECIPE_FILE, recipe)
        tokenizer.save(tmp)
        tok_cfg = read_json(tmp / "tokenizer_config.json", "tokenizer config")
        tok_cfg["model_max_length"] = int(cfg.data.seq_len)
        from data_pipeline.chat_template import default_chat_template  # its own, else ChatML where it has the tokens

        template = default_chat_template(tokenizer)
        if template:
            tok_cfg["chat_template"] = template
        _write_json(tmp / "tokenizer_config.json", tok_cfg)
        for f in code:
            shutil.copyfile(HF_CODE_DIR / f, tmp / f)
        (tmp / "README.md").write_text(card)
    log(f"setdlm convert: wrote {out} ({len(files)} weight file(s), {parameter_total(hf) / 1e6:.2f}M parameters, "
        f"{dtype}, {'EMA' if used_ema else 'raw'} weights of {ckpt}; "
        + (f"stock {mtype}: AutoModelForCausalLM loads it without trust_remote_code)" if mtype else
           "setdlm modeling code: trust_remote_code=True)"))
    return Path(out)


def _normalize_weights(cfg, weights: dict) -> dict:
    """`weights` loaded into a tp=1 Transformer of `cfg` (checking names and shapes): its state dict."""
    from .checkpoint.inference import model_with_weights

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
    from .checkpoint.rng import rng_state
    from .config import save_config

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
    with staging(out, overwrite, "run directory", need=_tensor_bytes(state)) as tmp:
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


def _run_config(raw: dict, overrides):
    from .config import _merge, from_dict, parse_overrides

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
        raise ConvertError(f"{d / 'config.json'}: model_type is {config.get('model_type')!r}, not 'setdlm'; for the "
                           "reference implementation's checkpoints use `setdlm convert from-reference`")
    model_sec, obj_sec, seq_len = configs_from_hf(config)
    recipe_file = d / RECIPE_FILE
    saved = read_json(recipe_file, "recipe") if recipe_file.is_file() else {}
    raw = {k: dict(v) for k, v in (saved.get("recipe") or {}).items() if isinstance(v, dict)}
    raw["model"] = {**model_sec, "preset": None}
    if raw.get("objective", {}).get("name") != obj_sec["name"]:
        raw["objective"] = obj_sec
    raw.setdefault("data", {})["seq_len"] = seq_len
    if not (d / "tokenizer.json").is_file():
        raise ConvertError(f"{d}: tokenizer.json is missing (incomplete export: the tokenizer files are needed)")
    cfg = _run_config(raw, overrides)
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
    from .safe_load import load_foreign

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
    from .safe_load import inert_entries

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
    cfg = _run_config(raw, overrides)
    Vp = cfg.model.padded_vocab_size
    for k in ("embed.weight", "head.weight", "head.bias"):
        train_sd[k] = pad_rows(train_sd[k][:V], Vp)
    if arch["adaln"]:
        log(f"setdlm convert: time conditioning (adaLN) folded at sigma={sigma}: exact for models trained without "
            "time conditioning (the reference's default)")
    info = {"from": "reference", "path": str(Path(path).resolve()), "family": family, "adaln_sigma": sigma if arch["adaln"] else None,
            "weights": "ema" if used_ema else "raw"}
    return write_run(Path(out), cfg, train_sd, tok, info=info, overwrite=overwrite, log=log)


def export_at_end(run_dir, *, best: bool = False) -> str:
    """train.export_hf: export the run's latest checkpoint, or with `best` (train.keep_best) its best one
    (RUN:best, the released-model convention), EMA weights when present, to RUN/hf."""
    run_dir = Path(run_dir)
    src = f"{run_dir}:best" if best and rundir.best_record(rundir.checkpoints_dir(run_dir)) else str(run_dir)
    try:
        out = export_checkpoint(src, run_dir / EXPORT_SUBDIR, ema=True, overwrite=True, log=lambda m: None)
        stock = (json.loads((out / "config.json").read_text()).get("model_type") != "setdlm")
        how = ("AutoModelForCausalLM.from_pretrained(...)" if stock else
               "AutoModelForMaskedLM.from_pretrained(..., trust_remote_code=True)")
        return f"Hugging Face export of {src}: {out} ({how})"
    except StorageError as e:  # a full disk: one line and an error status (the last export is kept)
        raise StorageError(f"train.export_hf: {e}; the checkpoint is saved: free space and rerun `setdlm convert "
                           f"to-hf --checkpoint {src} --out {run_dir / EXPORT_SUBDIR} --overwrite`") from None
    except Exception as e:  # noqa: BLE001 - training is done and saved; report and let the user rerun
        return (f"Hugging Face export failed ({type(e).__name__}: {e}); the checkpoint is saved, rerun "
                f"`setdlm convert to-hf --checkpoint {src} --out {run_dir / EXPORT_SUBDIR}`")


# -- command line ----------------------------------------------------------------------------------
def _bool_flag(p, name: str, default: bool, help_: str) -> None:
    p.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction, default=default,
                   help=help_)


def build_parser() -> argparse.ArgumentParser:
    parser = CLIParser(prog="setdlm convert", description="Checkpoint conversion (docs/convert.md).")
    sub = parser.add_subparsers(dest="command", metavar="{to-hf,from-hf,from-reference,consolidate}")
    p = sub.add_parser("to-hf", help="export a training checkpoint as a Hugging Face model directory")
    p.add_argument("--checkpoint", required=True, help="run directory (newest checkpoint), RUN:best / RUN:STEP, its checkpoints/ folder, or one checkpoint")
    p.add_argument("--out", required=True, help="output directory")
    _bool_flag(p, "ema", True, "export the EMA weights when the checkpoint has them (default) or the raw weights")
    p.add_argument("--format", default="auto", choices=FORMATS, dest="fmt",
                   help="auto (default): a stock Qwen3/Llama/Mistral architecture for an AR model of that shape, else "
                        "setdlm's modeling code; stock: require the stock architecture; setdlm: always setdlm's code")
    lo = p.add_mutually_exclusive_group()
    lo.add_argument("--adapter-only", action="store_true",
                    help="a LoRA run: write only its adapters, as a PEFT adapter (adapter_config.json, "
                         "adapter_model.safetensors) for the --base-only export")
    lo.add_argument("--base-only", action="store_true",
                    help="a LoRA run: write the frozen base model, without the adapters (default: merged into it)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="weights dtype (default fp32)")
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this size (default 5GB)")
    p.add_argument("--results", nargs="*", default=[], help="metrics JSON files to list in the model card")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p = sub.add_parser("from-hf", help="turn an export back into a training run directory")
    p.add_argument("--model", required=True, help="directory written by `setdlm convert to-hf`")
    p.add_argument("--out", required=True, help="run directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("overrides", nargs="*", help="section.key=value recipe overrides (e.g. data.source=DIR train.lr=1e-4)")
    p = sub.add_parser("from-reference", help="import a checkpoint of the reference implementation (DiT backbone)")
    p.add_argument("--model", required=True, help="HF-style directory (config.json + weights) or a .ckpt/.pt/.bin file")
    p.add_argument("--out", required=True, help="run directory to create")
    p.add_argument("--family", choices=("setdlm", "bd3lm", "mdlm", "ar"), help="objective (default: from config.json)")
    p.add_argument("--set-size", type=int, help="SetDLM D (S_max = 2D), or the BD3-LM block size")
    p.add_argument("--seq-len", type=int, help="training sequence length L (default: config.json, else 1024)")
    p.add_argument("--n-heads", type=int, help="attention heads (default: config.json or the rotary buffer)")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 (MASK appended as 50257), bert-base-uncased, or a directory")
    _bool_flag(p, "ema", True, "use the EMA weights of a Lightning checkpoint when present")
    p.add_argument("--sigma", type=float, default=0.0, help="noise level at which adaLN time conditioning is folded")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    sub.add_parser("consolidate", help="consolidate a sharded (TP/PP/ZeRO-3) checkpoint", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`setdlm convert` (errors are reported by common.cli.run_command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "consolidate":
        from .checkpoint.consolidate import main as consolidate_main

        return consolidate_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    check_output_dir(args.out, "--out")  # a file, a read-only mount: refused before any checkpoint is read
    if args.command == "to-hf":
        export_checkpoint(args.checkpoint, args.out, ema=args.ema, dtype=args.dtype, max_shard_size=args.max_shard_size,
                          results=args.results, overwrite=args.overwrite, fmt=args.fmt,
                          lora="adapter" if args.adapter_only else "base" if args.base_only else "merge")
    elif args.command == "from-hf":
        import_hf(args.model, args.out, overrides=args.overrides, overwrite=args.overwrite)
    else:
        import_reference(args.model, args.out, family=args.family, set_size=args.set_size, seq_len=args.seq_len,
                         n_heads=args.n_heads, tokenizer=args.tokenizer, ema=args.ema, sigma=args.sigma,
                         overrides=args.overrides, overwrite=args.overwrite)
    return 0
