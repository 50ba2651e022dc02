"""Recipe configuration: YAML file + `section.key=value` overrides -> validated dataclasses.

A recipe has the sections run, model, objective, data, train, parallel, logging. Every key can be
overridden on the command line (`train.max_steps=6 model.dropout=0.0`); values are parsed as YAML.
Unknown sections or keys are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from data_pipeline.config import DataConfig
from model.config import ModelConfig, ObjectiveConfig, apply_preset


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = "runs"  # run directory = out_dir/name (a requeued job finds its checkpoints there)
    seed: int = 1234


@dataclass
class TrainConfig:
    max_steps: int = 1000
    micro_batch: int = 8  # sequences per rank per forward
    global_batch: int = 8  # sequences per optimizer step; accumulation = global / (micro * dp)
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine (both after linear warm-up)
    warmup_steps: int = 100
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    ema: float = 0.0  # 0 disables; the paper uses 0.9999
    precision: str = "auto"  # auto | fp32 | bf16 (bf16 weights, fp32 master weights; auto = bf16 on GPUs that support it)
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 0  # global batches (train.global_batch sequences) per validation; 0: the whole validation split
    save_every: int = 500
    keep_last: int = 2
    peak_tflops: float = 0.0  # per device, for MFU; 0: from a table of known GPUs, N/A elsewhere
    sample_at_end: bool = False
    sample_tokens: int = 48
    sample_prompt: str = ""
    export_hf: bool = False  # at the end: write RUN/hf, a Hugging Face export of the final checkpoint (docs/convert.md)
    sample_temperature: float = 0.0  # 0: greedy
    sample_top_p: float = 1.0
    sample_threshold: float = 0.0  # SetDLM/BD3-LM confidence threshold (0: one token per step)
    sample_repetition_penalty: float = 1.0


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0


@dataclass
class LoggingConfig:
    wandb: str = "auto"  # auto (offline without WANDB_API_KEY) | online | offline | disabled
    project: str = "setdlm"
    entity: str | None = None
    progress: bool = True


@dataclass
class RecipeConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, world_size: int = 1) -> None:
        """Everything that can be checked before any work starts; messages name the field."""
        p, t = self.parallel, self.train
        for name in ("tp", "pp"):
            if getattr(p, name) < 1:
                raise ValueError(f"parallel.{name}: must be >= 1, got {getattr(p, name)}")
        if p.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero_stage: must be 0, 1, 2 or 3, got {p.zero_stage}")
        if world_size % (p.tp * p.pp):
            raise ValueError(f"parallel.tp/parallel.pp: tp*pp = {p.tp}*{p.pp} does not divide the world size {world_size}")
        if p.pp > 1 and p.zero_stage > 1:
            raise ValueError(f"parallel.zero_stage: ZeRO-{p.zero_stage} cannot be combined with pipeline parallelism (parallel.pp={p.pp}); use zero_stage 0 or 1")
        if p.tp > 1 and p.zero_stage == 3:
            raise ValueError(f"parallel.zero_stage: ZeRO-3 is supported with tensor parallelism off (parallel.tp={p.tp}); "
                             "use zero_stage 0, 1 or 2 with tp > 1, or tp=1 with ZeRO-3")
        dp = world_size // (p.tp * p.pp)
        if t.micro_batch < 1:
            raise ValueError(f"train.micro_batch: must be >= 1, got {t.micro_batch}")
        if t.global_batch % (t.micro_batch * dp):
            raise ValueError(f"train.global_batch: {t.global_batch} is not divisible by train.micro_batch * data-parallel size = {t.micro_batch} * {dp}")
        if t.max_steps < 1:
            raise ValueError(f"train.max_steps: must be >= 1, got {t.max_steps}")
        if t.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"train.lr_schedule: unknown schedule {t.lr_schedule!r}; valid: constant, cosine")
        if t.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"train.precision: unknown precision {t.precision!r}; valid: auto, fp32, bf16")
        if not 0.0 <= t.ema < 1.0:
            raise ValueError(f"train.ema: decay must be in [0, 1), got {t.ema}")
        if self.logging.wandb not in ("auto", "online", "offline", "disabled"):
            raise ValueError(f"logging.wandb: unknown mode {self.logging.wandb!r}; valid: auto, online, offline, disabled")
        self.data.validate()
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len: {self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        self.model.validate(tp=p.tp)
        self.objective.validate(self.data.seq_len)
        if p.pp > self.model.n_layers:
            raise ValueError(f"parallel.pp: {p.pp} stages for {self.model.n_layers} layers")

    def resolve_vocab(self, tokenizer) -> None:
        """Fill model.vocab_size and model.mask_id from the tokenizer unless the recipe set them."""
        if self.model.vocab_size <= 0:
            self.model.vocab_size = tokenizer.vocab_size
        if self.model.mask_id < 0:
            if tokenizer.mask_id is None:
                raise ValueError(f"data.tokenizer: {self.data.tokenizer!r} has no MASK token; set model.mask_id "
                                 "or use a tokenizer with one")
            self.model.mask_id = tokenizer.mask_id

    def dp_size(self, world_size: int) -> int:
        return world_size // (self.parallel.tp * self.parallel.pp)

    def grad_accum(self, world_size: int) -> int:
        return self.train.global_batch // (self.train.micro_batch * self.dp_size(world_size))


_SECTIONS = {f.name: f.type for f in dataclasses.fields(RecipeConfig)}
_CLASSES = {"run": RunConfig, "model": ModelConfig, "objective": ObjectiveConfig, "data": DataConfig,
            "train": TrainConfig, "parallel": ParallelConfig, "logging": LoggingConfig}


def parse_overrides(items: list[str]) -> dict:
    out: dict = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"override {item!r}: expected section.key=value (for example train.max_steps=10)")
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = yaml.safe_load(value) if value != "" else None
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = {k: dict(v or {}) for k, v in base.items()}
    for section, values in extra.items():
        merged.setdefault(section, {}).update(values)
    return merged


def _coerce(cls, values: dict) -> dict:
    """YAML reads `1e-3` as a string: convert to the type of the field's default."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = {}
    for k, v in values.items():
        d = defaults.get(k)
        try:
            if isinstance(d, bool) or d is dataclasses.MISSING:
                pass
            elif isinstance(d, float) and isinstance(v, (str, int)) and not isinstance(v, bool):
                v = float(v)
            elif isinstance(d, int) and isinstance(v, str):
                v = int(v)
        except ValueError:
            raise ValueError(f"{cls.__name__.replace('Config', '').lower()}.{k}: expected a number, got {v!r}") from None
        out[k] = v
    return out


def from_dict(raw: dict) -> RecipeConfig:
    raw = dict(raw or {})
    unknown = sorted(set(raw) - set(_CLASSES))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown config section; valid sections: {', '.join(_CLASSES)}")
    sections = {}
    for name, cls in _CLASSES.items():
        values = dict(raw.get(name) or {})
        if name == "model":
            values = apply_preset(values)
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(values) - fields)
        if bad:
            raise ValueError(f"{name}.{bad[0]}: unknown key; valid keys: {', '.join(sorted(fields))}")
        values = _coerce(cls, values)
        try:
            sections[name] = cls(**values)
        except TypeError as e:  # pragma: no cover - defensive
            raise ValueError(f"{name}: {e}") from e
    return RecipeConfig(**sections)


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RecipeConfig:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--config: no such file {str(path)!r}")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"--config: {path} does not hold a mapping of sections")
    return from_dict(_merge(raw, parse_overrides(overrides or [])))


def save_config(cfg: RecipeConfig, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)
