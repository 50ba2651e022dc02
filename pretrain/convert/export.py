"""`setdlm convert to-hf`: a training checkpoint (any layout) as a Hugging Face model directory.

An AR model whose shape is a stock architecture (Qwen3, Llama, Mistral) exports as that architecture
(`--format auto`, the default; model/convert/hf_stock_export.py), every other model with setdlm's
modeling code. A LoRA run (`train.lora`) exports with its adapters merged; `--adapter-only` writes them
as a PEFT adapter (pretrain/convert/adapter.py) and `--base-only` the frozen base model it loads onto.
`train.export_hf` calls `export_at_end` when a run finishes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common.errors import StorageError
from common.jsonl import read_jsonl

from model import families
from model.convert.card import render_card, render_stock_card
from model.convert.errors import ConvertError
from model.convert.hf_config import CODE_FILES, HF_CODE_DIR, RECIPE_FILE, hf_config
from model.convert.hf_files import DTYPES, cast, parameter_total, parse_size, read_json, write_weights
from model.convert.hf_map import to_hf_state_dict
from model.convert.hf_stock_export import export_type, stock_config
from model.convert.hf_stock_export import generation_config as stock_generation

from ..checkpoint import rundir
from .staging import staging, tensor_bytes, write_json

__all__ = ["EXPORT_SUBDIR", "LORA_EXPORTS", "read_checkpoint", "collect_results", "export_checkpoint", "export_at_end"]

EXPORT_SUBDIR = "hf"  # train.export_hf writes RUN/hf


def read_checkpoint(path, *, ema: bool = True, merge_lora: bool = True):
    """(checkpoint dir, meta, RecipeConfig, tp=1 weights, whether EMA weights were used); LoRA adapters
    merged into the weights unless `merge_lora=False`."""
    from ..checkpoint.inference import checkpoint_weights

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
    template = _carried_template(tokenizer)
    mtype = export_type(cfg, fmt)
    if lora != "merge":
        from .adapter import adapter_files, split_adapters, write_adapter_files

        flag = "--adapter-only" if lora == "adapter" else "--base-only"
        weights, adapters = split_adapters(weights, cfg, ckpt, flag)
        if lora == "adapter":  # a PEFT adapter directory (pretrain/convert/adapter.py)
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
                  "set_diffusion": {"family": sd["family"], "window": families.get(sd["family"]).export_window(sd),
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
    with staging(Path(out), overwrite, "output directory", need=tensor_bytes(hf)) as tmp:
        files = write_weights(hf, tmp, shard_bytes)
        if mtype is not None:
            stock.save_pretrained(str(tmp))
        else:
            write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", generation)
        write_json(tmp / RECIPE_FILE, recipe)
        tokenizer.save(tmp)
        tok_cfg = read_json(tmp / "tokenizer_config.json", "tokenizer config")
        tok_cfg["model_max_length"] = int(cfg.data.seq_len)
        if template:
            tok_cfg["chat_template"] = template
        write_json(tmp / "tokenizer_config.json", tok_cfg)
        for f in code:
            shutil.copyfile(HF_CODE_DIR / f, tmp / f)
        (tmp / "README.md").write_text(card)
    log(f"setdlm convert: wrote {out} ({len(files)} weight file(s), {parameter_total(hf) / 1e6:.2f}M parameters, "
        f"{dtype}, {'EMA' if used_ema else 'raw'} weights of {ckpt}; "
        + (f"stock {mtype}: AutoModelForCausalLM loads it without trust_remote_code)" if mtype else
           "setdlm modeling code: trust_remote_code=True)"))
    return Path(out)



def _carried_template(tokenizer) -> str | None:
    """The chat template the export carries (the tokenizer's own, else ChatML where it has the tokens),
    checked to render under the time, memory and output limits before anything is written: a template
    that loops would hang every `apply_chat_template` of the export's users."""
    from data_pipeline.chat_template import check_chat_template, default_chat_template

    template = default_chat_template(tokenizer)
    if template:
        names = {"eos_token": tokenizer.eos_id, "bos_token": tokenizer.bos_id, "pad_token": tokenizer.pad_id}
        check_chat_template(template, {k: tokenizer.id_to_token(v) for k, v in names.items() if v is not None},
                            name=f"the chat template of tokenizer {tokenizer.name!r} (carried into the export's "
                                 f"tokenizer_config.json)")
    return template


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


