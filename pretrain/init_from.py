"""`train.init_from`: start a run from pretrained weights (docs/finetune.md).

Two kinds of source:
- a stock Hugging Face causal-LM directory (Qwen3, Llama, Mistral; model/convert/hf_stock.py): the
  `model:` architecture comes from its config.json, the tokenizer from the directory (MASK appended
  when it has none), the weights from its safetensors;
- a setdlm run directory or checkpoint of any layout (consolidated on the fly, EMA weights when it
  has them): architecture and tokenizer from the checkpoint.

Only the weights are taken: AdamW moments, LR schedule, step and data position start fresh. Two
calls from the trainer: `prepare(cfg)` before anything is built (fills the recipe, checks the source
and the vocabulary, so bad input fails before any work) and `load(engine, source, ema)` once the
engine exists and no checkpoint of this run was found. A run that already has a checkpoint resumes
from it and never reads the source again (`prepare` then takes the architecture from that checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.schema import ConfigError
from model.config import PRESET_VOCAB, PRESETS
from model.convert import hf_stock
from model.convert.errors import ConvertError

from .checkpoint import rundir
from .safe_load import CheckpointError

@dataclass
class InitSource:
    kind: str  # "hf" | "checkpoint" | "resume"
    path: Path
    n_real: int = 0  # hf: tokenizer ids with an HF embedding row
    notes: list = field(default_factory=list)


def _bad(msg: str):
    raise ConfigError(f"train.init_from: {msg}")


def _merge_model(cfg, derived: dict, where: str, notes: list) -> None:
    """Put the source's architecture into cfg.model. A value the recipe gives (itself, its preset or an
    override) that differs from the source is an error naming the field; a field the recipe leaves
    unset is taken from the source, and the fields that change are said in one note."""
    preset = PRESETS.get(cfg.model.preset or "", {})
    taken = []
    for name, value in derived.items():
        mine = {"n_kv_heads": cfg.model.kv_heads, "head_dim": cfg.model.dim_head}.get(name, getattr(cfg.model, name))
        if cfg.given(f"model.{name}") and mine != value:
            src = f" (from preset {cfg.model.preset!r})" if name in preset else ""
            raise ConfigError(f"model.{name}: the recipe sets {mine!r}{src} but {where} has {value!r}; remove "
                              f"model.{name}{' or the preset' if src else ''} from the recipe, or make it agree")
        if mine != value:
            taken.append(f"{name} {value}")
        setattr(cfg.model, name, value)
    if taken:
        notes.append(f"init_from: model from {where}: " + ", ".join(taken))


def _adjust(cfg, key: str, value, why: str, notes: list) -> None:
    """Set recipe key `key` (dotted) to `value` unless the recipe gives it; a change is one note."""
    section_name, name = key.split(".", 1)
    sec = getattr(cfg, section_name)
    if cfg.given(key) or getattr(sec, name) == value:
        return
    notes.append(f"init_from: {key} {getattr(sec, name)!r} -> {value!r} ({why}; set {key} in the recipe to keep another)")
    setattr(sec, name, value)


def _arch(model_cfg) -> dict:
    """ARCH_FIELDS of a ModelConfig, with KV heads and head size explicit."""
    out = {k: getattr(model_cfg, k) for k in hf_stock.ARCH_FIELDS}
    out.update(n_kv_heads=model_cfg.kv_heads, head_dim=model_cfg.dim_head)
    return out


def _resume_source(cfg, ckpt: Path) -> InitSource:
    """The run already has checkpoints: its saved architecture and tokenizer, no import."""
    from model.config import model_config_from_dict

    saved = rundir.read_meta(ckpt)["config"]
    notes: list[str] = []
    where = f"this run's checkpoint {ckpt}"
    _merge_model(cfg, _arch(model_config_from_dict({**saved.get("model", {}), "preset": None})), where, notes)
    for name in ("dropout", "max_seq_len"):  # the values the import chose when the recipe left them unset
        if name in saved.get("model", {}):
            _adjust(cfg, f"model.{name}", saved["model"][name], f"as {where}", notes)
    sd = saved.get("data", {})
    if not cfg.given("data.tokenizer") and sd.get("tokenizer"):
        # the run's own copy (RUN/tokenizer): the source may be gone by now
        _adjust(cfg, "data.tokenizer", rundir.tokenizer_location(ckpt, sd["tokenizer"]), f"as {where}", notes)
        _adjust(cfg, "data.add_mask_token", bool(sd.get("add_mask_token", cfg.data.add_mask_token)), f"as {where}", notes)
    return InitSource("resume", ckpt, notes=notes)


def _tokenizer(cfg):
    from data_pipeline.tokenizers import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token)
    except TokenizerError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None


def _prepare_hf(cfg, d: Path) -> InitSource:
    from data_pipeline.tokenizers import TokenizerError, load_tokenizer

    try:
        config = hf_stock.read_config(d)
    except ConvertError as e:
        _bad(str(e))
    notes: list[str] = []
    _merge_model(cfg, hf_stock.model_section(config, d / "config.json"), f"{d}/config.json", notes)
    if config.get("max_position_embeddings"):
        _adjust(cfg, "model.max_seq_len", int(config["max_position_embeddings"]),
                "config.json max_position_embeddings", notes)
    _adjust(cfg, "model.dropout", 0.0, "Hugging Face causal LMs of these families train without dropout", notes)
    if not cfg.given("data.tokenizer"):
        if not ((d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()):
            _bad(f"{d} has no tokenizer files (tokenizer.json); set data.tokenizer to the model's tokenizer")
        _adjust(cfg, "data.tokenizer", str(d), "the model's own tokenizer", notes)
    try:
        load_tokenizer(cfg.data.tokenizer)
        had_mask = True
    except TokenizerError:
        had_mask = False
    if not had_mask:
        _adjust(cfg, "data.add_mask_token", True, "the tokenizer has no MASK token", notes)
    tok = _tokenizer(cfg)
    n_real = tok.vocab_size - (0 if had_mask else 1)
    rows = hf_stock.embedding_rows(config)
    if n_real > rows:
        raise ConfigError(f"data.tokenizer: {tok.name!r} has {n_real} tokens but the model in {d} embeds {rows} "
                          "(config.json vocab_size): a tokenizer/model vocabulary mismatch; use the model's own tokenizer")
    if rows - n_real > 4096:
        raise ConfigError(f"data.tokenizer: {tok.name!r} has {n_real} tokens, far fewer than the {rows} rows of the model "
                          f"in {d}: a tokenizer/model vocabulary mismatch; use the model's own tokenizer")
    eos = config.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if eos and tok.eos_id is not None and tok.eos_id not in eos:
        raise ConfigError(f"data.tokenizer: {tok.name!r} has EOS id {tok.eos_id}, the model in {d} was trained with "
                          f"{eos} (config.json eos_token_id): a tokenizer/model vocabulary mismatch")
    notes.append(f"init_from: weights of {d} ({config.get('model_type')}, {rows} embedding rows -> vocabulary "
                 f"{tok.vocab_size}" + ("" if had_mask else f", MASK {tok.mask_token!r} = id {tok.mask_id} added as "
                                        "the mean embedding") + "); optimizer, schedule and data start fresh")
    return InitSource("hf", d, n_real=n_real, notes=notes)


def _refuse_reference_release(d: Path) -> None:
    """A checkpoint of the reference implementation is imported first (its config.json is not a causal LM's)."""
    from model.convert.hf_files import read_json
    from model.convert.reference import family_from_config

    config = read_json(d / "config.json", "model config")
    if config.get("backbone_config") is not None and family_from_config(config):
        _bad(f"{d} is a checkpoint of the reference implementation (architectures {config.get('architectures')}); "
             f"import it with `setdlm convert from-reference --model {d} --out RUN` and set train.init_from=RUN")


def _prepare_checkpoint(cfg, d: Path) -> InitSource:
    notes: list[str] = []  # a `latest` that names a damaged step: the fallback, said once
    try:
        ckpt = rundir.resolve_checkpoint(d, notes=notes)
        meta = rundir.read_meta(ckpt)
        src_cfg = rundir.read_recipe(ckpt, meta)
    except CheckpointError as e:
        _bad(f"{d}: not a Hugging Face model directory (no config.json) nor a readable setdlm checkpoint ({e})")
    _merge_model(cfg, _arch(src_cfg.model), f"checkpoint {ckpt}", notes)
    # the source's context (a release's own length, not the recipe's default 1024) unless the recipe sets one;
    # at least data.seq_len, which a fine-tune may set longer on purpose
    length = max(int(src_cfg.model.max_seq_len), int(cfg.data.seq_len))
    _adjust(cfg, "model.max_seq_len", length, f"as checkpoint {ckpt}" if length == src_cfg.model.max_seq_len else
            f"data.seq_len, longer than the {src_cfg.model.max_seq_len} of checkpoint {ckpt}", notes)
    if not cfg.given("data.tokenizer"):
        _adjust(cfg, "data.tokenizer", rundir.tokenizer_location(ckpt, src_cfg.data.tokenizer),
                f"the tokenizer of checkpoint {ckpt}", notes)
        _adjust(cfg, "data.add_mask_token", src_cfg.data.add_mask_token, f"as checkpoint {ckpt}", notes)
    tok = _tokenizer(cfg)
    try:
        rundir.check_tokenizer(tok, meta, ckpt)
    except CheckpointError as e:
        raise ConfigError(f"data.tokenizer: {e}: a tokenizer/model vocabulary mismatch") from None
    if tok.vocab_size != src_cfg.model.vocab_size and not (tok.vocab_size < src_cfg.model.vocab_size and
                                                           meta.get("imported")):
        raise ConfigError(f"data.tokenizer: {tok.vocab_size} tokens, checkpoint {ckpt} has a {src_cfg.model.vocab_size}-token "
                          "vocabulary: a tokenizer/model vocabulary mismatch")
    if meta.get("imported"):  # an imported release keeps all its embedding rows, and its decoding mode
        _adjust(cfg, "model.vocab_size", src_cfg.model.vocab_size, "an imported release keeps all its embedding rows",
                notes)
        if cfg.objective.name == src_cfg.objective.name:
            _adjust(cfg, "objective.cache_order", src_cfg.objective.cache_order,
                    f"the decoding mode checkpoint {ckpt} was released with", notes)
    _merge_model(cfg, {"vocab_pad_multiple": src_cfg.model.vocab_pad_multiple}, f"checkpoint {ckpt}", notes)
    notes.append(f"init_from: weights of checkpoint {ckpt} (step {meta.get('step')}); optimizer, schedule and data "
                 "start fresh")
    return InitSource("checkpoint", ckpt, notes=notes)


def prepare(cfg) -> InitSource | None:
    """Fill the recipe from `train.init_from` and check it; None when the run does not use it."""
    src = getattr(cfg.train, "init_from", None)
    if not src:
        return None
    own = rundir.latest_checkpoint(rundir.checkpoints_dir(cfg.run_dir))  # a fallback is reported when resuming
    if own is not None:
        return _resume_source(cfg, own)
    d = Path(str(src)).expanduser()
    base, selector = rundir.split_selector(d)  # RUN:best, RUN:latest, RUN:STEP
    if not base.exists():
        _bad(f"{str(src)!r} does not exist (expected a Hugging Face model directory or a setdlm run/checkpoint)")
    if selector is not None:
        return _prepare_checkpoint(cfg, Path(f"{base.resolve()}:{selector}"))
    if d.is_dir() and (d / "config.json").is_file() and not (d / rundir.META).is_file():
        _refuse_reference_release(d)
        return _prepare_hf(cfg, d.resolve())
    return _prepare_checkpoint(cfg, d.resolve())


def prepare_for_plan(cfg) -> str | None:
    """`--dry-run`: fill the recipe from `train.init_from` as a run would (the source's architecture and
    tokenizer, no weights read) when the source is on this machine; otherwise a note that the plan uses
    the recipe's own model section and tokenizer. None when the recipe has no init_from."""
    src = getattr(cfg.train, "init_from", None)
    if not src:
        return None
    if not rundir.split_selector(Path(str(src)).expanduser())[0].exists():
        vocab = PRESET_VOCAB.get(cfg.model.preset or "")
        if vocab and not cfg.given("data.tokenizer") and cfg.model.vocab_size <= 0 and cfg.model.mask_id < 0:
            cfg.model.vocab_size, cfg.model.mask_id = vocab  # the source's tokenizer would give these
            return (f"note: train.init_from {str(src)!r} is not on this machine: planned with the recipe's model section "
                    f"and the {cfg.model.preset} preset's vocabulary ({vocab[0]:,} tokens with MASK id {vocab[1]})")
        return (f"note: train.init_from {str(src)!r} is not on this machine: planned with the recipe's model section "
                f"and data.tokenizer {cfg.data.tokenizer!r} (set model.vocab_size / model.mask_id to the source's)")
    prepare(cfg)
    cfg.resolve_vocab(_tokenizer(cfg))  # with the MASK token the run appends
    return f"planned with the architecture and tokenizer of train.init_from {src}"


def weights(source: InitSource, model_cfg):
    """Our tp=1 name -> full tensor mapping of the source (lazy for HF directories)."""
    if source.kind == "hf":
        try:
            return hf_stock.HFWeights(source.path, model_cfg, source.n_real)
        except ConvertError as e:
            _bad(str(e))
    from .checkpoint.inference import checkpoint_weights

    try:
        w, _ = checkpoint_weights(source.path, rundir.read_meta(source.path), ema=True)
    except CheckpointError as e:
        _bad(str(e))
    return w


def load(engine, source: InitSource | None, model_cfg, ema=None) -> list[str]:
    """Copy the source's weights into this rank's shard (any TP x PP x DP layout, ZeRO 0-3) and its fp32
    masters; EMA (when on) starts from them. Returns notes for the log."""
    if source is None:
        return []
    if source.kind == "resume":
        return list(source.notes)
    from .checkpoint.relayout import load_consolidated

    from model.lora import is_adapter

    w = weights(source, model_cfg)
    try:  # LoRA adapters are not in the source: they keep their initial values (B = 0: the source's model)
        load_consolidated(engine, {"module": w, "ema": w if ema is not None else None, "optimizer": None},
                          ema=ema, optimizer=False, optional=is_adapter)
    except CheckpointError as e:
        _bad(f"{source.path}: {e}")
    return list(source.notes)


__all__ = ["InitSource", "prepare", "prepare_for_plan", "load", "weights"]
