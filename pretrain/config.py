"""Recipe configuration: YAML file + `section.key=value` overrides -> typed, validated sections.

A recipe has the sections run, model, objective, data, train, parallel, logging; a recipe file must
write the four a run cannot do without (model, objective, data, train). Every field is typed, ranged
and described (common/schema.py; `setdlm pretrain --describe` lists them). Every key can be
overridden on the command line (`train.max_steps=6 model.dropout=0.0`); values are read as YAML,
except for string fields, which take the text as written. Unknown sections or keys, wrong types and
out-of-range values are one-line errors that name the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BeforeValidator, field_validator, model_validator

from common.io import atomic_write_text
from common.schema import ConfigError, Field, Text, annotation_is_nullable, annotation_is_text, check_keys, section
from common.yamlfile import load_yaml, parse_value
from data_pipeline.config import DataConfig
from model.config import ModelConfig, ObjectiveConfig, apply_preset

REQUIRED_SECTIONS = ("model", "objective", "data", "train")


@section("run")
class RunConfig:
    name: Text = Field("run", min_length=1, description="run name; the run directory is out_dir/name (a Slurm job id works)")
    out_dir: Text = Field("runs", min_length=1, description="parent of run directories (a requeued job finds its checkpoints there)")
    seed: int = Field(1234, ge=0, description="seed of weights, data order, orders/noise and validation")

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, v: str) -> str:
        if "/" in v or "\\" in v or v in (".", ".."):
            raise ValueError(f"run.name: must be a single directory name (no '/', not '.' or '..'), got {v!r}")
        return v


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")


@section("train.lora")
class LoRAConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the block linears: W x + (alpha / rank) B A x, with A
    [rank, in] Gaussian (std 1/rank, PEFT's "gaussian" init) and B [out, rank] zero, so step 0 is the
    base model; only A and B train (model/lora.py, pretrain/parallelize.py)."""

    rank: int = Field(8, ge=1, description="adapter rank r")
    alpha: float = Field(16.0, gt=0.0, description="scaling numerator: the update is (alpha / rank) B A x")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input (the base path has none)")
    targets: list[Literal[LORA_TARGETS]] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1, description=(
        "linears adapted: qkv (q/k/v_proj), proj (o_proj), fc1 (gate/up_proj), fc2 (down_proj)"))
    random_base: bool = Field(False, description=(
        "allow adapters on a randomly initialised, frozen base (no train.init_from): for tests and experiments; "
        "a fine-tune sets train.init_from instead"))


def _lora_section(value):
    if value is None or isinstance(value, LoRAConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"train.lora: must be a mapping of rank, alpha, dropout, targets (or null), got {value!r}")
    return LoRAConfig(**value)


@section("train")
class TrainConfig:
    max_steps: int = Field(1000, ge=1, description="optimizer steps to train for (or set train.epochs)")
    epochs: float | None = Field(None, gt=0.0, description=(
        "instead of max_steps: passes over the training split; max_steps = ceil(epochs * train sequences / "
        "global_batch), resolved and printed at start"))
    micro_batch: int = Field(8, ge=1, description="sequences per rank per forward")
    global_batch: int = Field(8, ge=1, description="sequences per optimizer step; accumulation = global / (micro * dp)")
    lr: float = Field(3e-4, gt=0.0, description="peak learning rate (after warm-up)")
    min_lr: float = Field(0.0, ge=0.0, description="cosine: final learning rate, <= lr (constant: unused)")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="LR after the linear warm-up")
    warmup_steps: int = Field(100, ge=0, description="linear warm-up steps from 0 to lr")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay (see train.weight_decay_style)")
    weight_decay_style: Literal["adamw", "decoupled"] = Field("adamw", description=(
        "adamw: torch's, matrices decay by lr_t * weight_decay per step, norms and biases not at all; decoupled: "
        "Composer's DecoupledAdamW (the reference's), every parameter decays by (lr_t / lr) * weight_decay"))
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW first-moment decay")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW second-moment decay")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0.0, description="clip the global gradient norm to this (0: no clipping)")
    ema: float = Field(0.0, ge=0.0, lt=1.0, description="EMA decay of the weights (0: off; the paper uses 0.9999)")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description=(
        "bf16: bf16 weights, fp32 master weights; auto: bf16 on GPUs that support it, else fp32"))
    log_every: int = Field(10, ge=1, description="steps between console lines / metrics.jsonl rows")
    eval_every: int = Field(100, ge=0, description="steps between validations (0: no validation)")
    eval_batches: int = Field(0, ge=0, description="validation global batches of train.global_batch sequences (0: the whole validation split)")
    save_every: int = Field(500, ge=1, description="steps between checkpoints (the last step and a preemption always save)")
    preemption_check_every: int = Field(10, ge=1, description=(
        "steps between the ranks' agreement on a preemption signal (one all-reduce that waits for the host); a "
        "signal is honoured within this many steps, so keep them shorter than Slurm's --signal lead time; one "
        "process checks every step"))
    keep_last: int = Field(2, ge=0, description="complete checkpoints kept (0: keep all)")
    async_save: bool = Field(True, description=(
        "write checkpoints in the background: the step loop waits only for the copy of this rank's share of the "
        "checkpoint to host memory (a buffer kept between saves), training goes on while the files are written "
        "(false: write in the step loop)"))
    keep_best: bool = Field(False, description=(
        "also keep the checkpoint with the best train.best_metric (RUN/checkpoints/best, outside keep_last); "
        "select it with --checkpoint RUN:best"))
    best_metric: Text = Field("val/nll", min_length=1, description="validation metric train.keep_best ranks by")
    best_mode: Literal["min", "max"] = Field("min", description="min: lower train.best_metric is better; max: higher")
    peak_tflops: float = Field(0.0, ge=0.0, description=(
        "per-device peak TFLOP/s that perf/mfu and perf/hfu divide by (0: the detected GPU's datasheet bf16 "
        "dense peak, pretrain/flops.py; N/A on CPU or an unknown GPU)"))
    sample_at_end: bool = Field(False, description="print a sample from the final model")
    sample_tokens: int = Field(48, ge=1, description="tokens of the end-of-run sample")
    sample_prompt: Text = Field("", description="prompt of the end-of-run sample (empty: unconditional)")
    export_hf: bool = Field(False, description=(
        "at the end: write RUN/hf, a Hugging Face export of the final checkpoint (with train.keep_best: the best)"))
    sample_temperature: float = Field(0.0, ge=0.0, description="end-of-run sample temperature (0: greedy)")
    sample_top_p: float = Field(1.0, gt=0.0, le=1.0, description="end-of-run sample nucleus mass")
    sample_threshold: float = Field(0.0, ge=0.0, le=1.0, description=(
        "SetDLM/BD3-LM confidence threshold of the end-of-run sample (0: one token per step)"))
    sample_repetition_penalty: float = Field(1.0, gt=0.0, description="end-of-run sample repetition penalty (1: none)")
    init_from: Text | None = Field(None, min_length=1, description=(
        "start from these weights: a Hugging Face causal-LM directory or a setdlm run/checkpoint (docs/finetune.md)"))
    activation_checkpointing: Literal["none", "selective", "full"] = Field("none", description=(
        "recompute in the backward: none, selective (attention core + MLP activation) or full (every block)"))
    compile: bool = Field(False, description="torch.compile each block (inductor; eager with a message where unavailable)")
    lora: Annotated[LoRAConfig | None, BeforeValidator(_lora_section)] = Field(None, description=(
        "low-rank adapters {rank, alpha, dropout, targets} on the block linears, the base frozen (null: full "
        "fine-tuning); setdlm pretrain --describe train.lora"))

    @model_validator(mode="after")
    def _min_lr_below_lr(self):
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr: {self.min_lr} must be <= train.lr={self.lr}")
        return self


@section("parallel")
class ParallelConfig:
    tp: int = Field(1, ge=1, description="tensor-parallel size (megatron-core layers); divides heads and ffn_hidden")
    pp: int = Field(1, ge=1, description="pipeline stages (1F1B schedule); tp * pp divides the world size")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage over the data-parallel group")
    overlap_comm: bool = Field(False, description=(
        "DeepSpeed's zero_optimization.overlap_comm for ZeRO-1/2: the gradient reduction runs beside the backward "
        "(ZeRO-2: every micro-batch's; ZeRO-1: the last one's) at the cost of a second gradient bucket (0.93 GiB "
        "in bf16); ZeRO-3 always overlaps; not with pipeline parallelism"))
    sequence_parallel: bool = Field(False, description=(
        "megatron sequence parallelism over the TP group (needs tp >= 2; norms/dropout on T/tp tokens)"))
    world_size: int | None = Field(None, ge=1, le=1 << 20, description=(
        "ranks (GPUs) the recipe is written for: --dry-run plans for it unless --world-size is given; a run "
        "under another world size is allowed (null: 1 for the dry run)"))
    collective_timeout_s: float = Field(600.0, gt=0.0, description=(
        "seconds a collective (and the start-up rendezvous) waits for the other ranks before it fails"))
    heartbeat_timeout_s: float = Field(60.0, ge=0.0, description=(
        "seconds without a heartbeat after which a rank on another host is declared lost (ranks on the same "
        "host are checked by process; 0: off, only parallel.collective_timeout_s)"))
    cp: int = Field(1, ge=1, description=(
        "context-parallel size: each sequence split over cp ranks (head-tail chunks of both streams, only the "
        "clean stream's K/V exchanged; data.seq_len divisible by 2 * cp); tp * cp * pp divides the world size; "
        "gradients and ZeRO reduce over dp x cp (docs/parallelism.md)"))


@section("logging")
class LoggingConfig:
    wandb: Literal["auto", "online", "offline", "disabled"] = Field("auto", description=(
        "auto: online only if WANDB_API_KEY is set and the server answers within 2 s, else offline"))
    project: Text = Field("setdlm", min_length=1, description="wandb project")
    entity: Text | None = Field(None, description="wandb entity (null: the account's default)")
    progress: bool = Field(True, description="tqdm progress bar on a terminal (SETDLM_PROGRESS=1 forces it)")


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

    def given(self, key: str) -> bool:
        """Whether dotted `key` (`model.dropout`) was written in the recipe, its preset or an override,
        as opposed to left at its default. A recipe built in code (not by from_dict) knows no more than
        the values: a key counts as given when it differs from the default."""
        given = self.__dict__.get("_given")
        if given is not None:
            return key in given
        section_name, name = key.split(".", 1)
        return getattr(getattr(self, section_name), name) != getattr(_CLASSES[section_name](), name)

    def validate(self, world_size: int | None = 1, need_vocab: bool = True) -> None:
        """Checks across fields and sections (each field's type and range are checked on construction).
        `world_size=None` skips the layout checks that need it; `need_vocab=False` those that need the
        tokenizer's vocabulary. Messages name the field."""
        p, t = self.parallel, self.train
        if world_size is not None and world_size % (p.tp * p.pp * p.cp):
            if p.cp == 1:
                raise ConfigError(f"parallel.tp/parallel.pp: tp*pp = {p.tp}*{p.pp} does not divide the world size {world_size}")
            raise ConfigError(f"parallel.cp: tp*cp*pp = {p.tp}*{p.cp}*{p.pp} does not divide the world size {world_size}")
        if p.pp > 1 and p.zero_stage > 1:
            raise ConfigError(f"parallel.zero_stage: ZeRO-{p.zero_stage} cannot be combined with pipeline parallelism (parallel.pp={p.pp}); use zero_stage 0 or 1")
        if p.tp > 1 and p.zero_stage == 3:
            raise ConfigError(f"parallel.zero_stage: ZeRO-3 is supported with tensor parallelism off (parallel.tp={p.tp}); "
                              "use zero_stage 0, 1 or 2 with tp > 1, or tp=1 with ZeRO-3")
        if t.compile and p.zero_stage == 3:
            raise ConfigError("train.compile: DeepSpeed ZeRO-3 gathers parameters in module hooks that the compiled "
                              "blocks do not run; use parallel.zero_stage 0-2 with compile, or train.compile: false")
        if t.keep_best and t.eval_every == 0:
            raise ConfigError("train.keep_best: ranks checkpoints by validation, which train.eval_every: 0 turns off; "
                              "set train.eval_every > 0 or train.keep_best: false")
        if t.lora is not None and self.model.fp8 != "none":
            raise ConfigError("train.lora: the adapters hook the block linears that model.fp8 replaces with Transformer "
                              "Engine layers; use model.fp8: none with LoRA")
        if t.lora is not None and not t.init_from and not t.lora.random_base:
            raise ConfigError("train.lora: adapters train on a frozen base, and without train.init_from that base is "
                              "random weights; set train.init_from (a Hugging Face directory or a setdlm run), or "
                              "train.lora.random_base: true to train on a random base on purpose")
        if p.overlap_comm and p.zero_stage not in (1, 2):
            raise ConfigError(f"parallel.overlap_comm: overlaps ZeRO-1/2's gradient reduction with the backward; "
                              f"parallel.zero_stage={p.zero_stage} has none to overlap (ZeRO-3 always overlaps); set it to false")
        if p.overlap_comm and p.pp > 1:
            raise ConfigError(f"parallel.overlap_comm: reduces gradients in DeepSpeed's backward hooks, which the pipeline "
                              f"schedule (parallel.pp={p.pp}) runs outside of; set it to false with pp > 1")
        if p.sequence_parallel and p.tp < 2:
            raise ConfigError(f"parallel.sequence_parallel: needs tensor parallelism (parallel.tp >= 2, got {p.tp}); "
                              "set it to false or raise parallel.tp")
        if world_size is not None:
            dp = self.dp_size(world_size)
            if t.global_batch % (t.micro_batch * dp):
                raise ConfigError(f"train.global_batch: {t.global_batch} is not divisible by train.micro_batch * data-parallel size = {t.micro_batch} * {dp}")
        self.data.validate()
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len: {self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        self.model.validate(tp=p.tp, need_vocab=need_vocab)
        if t.lora is not None and (need_vocab or not t.init_from):  # the model section is final (init_from filled it)
            self._check_lora_rank()
        self.objective.validate(self.data.seq_len)
        if p.pp > self.model.n_layers:
            raise ConfigError(f"parallel.pp: {p.pp} stages for {self.model.n_layers} layers")
        if p.cp > 1:  # head-tail chunks: 2 * cp equal chunks, each a whole number of BD3-LM blocks
            from model.context_parallel import check_layout

            family = self.objective.family
            check_layout(family.mask_kind, self.data.seq_len, p.cp, self.objective.block_size if family.blocked_mask else 0)
        if p.sequence_parallel:
            tokens = self.objective.family.layout(self.data.seq_len).tokens_in // p.cp
            if tokens % p.tp:
                where = "per sequence" if p.cp == 1 else f"per sequence on each of the parallel.cp={p.cp} ranks"
                raise ConfigError(f"parallel.sequence_parallel: {tokens} tokens {where} through the model are not "
                                  f"divisible by parallel.tp={p.tp}; choose data.seq_len so that they are")

    def _check_lora_rank(self) -> None:
        from model.lora import rank_limit

        limit, name, (n_in, n_out) = rank_limit(self.model, self.train.lora.targets)
        if self.train.lora.rank > limit:
            raise ConfigError(f"train.lora.rank: {self.train.lora.rank} is above the width of the adapted linear "
                              f"{name} ({n_in} in, {n_out} out), so B A cannot use it; set train.lora.rank <= {limit}")

    def resolve_vocab(self, tokenizer) -> None:
        """Fill model.vocab_size and model.mask_id from the tokenizer unless the recipe set them."""
        if self.model.vocab_size <= 0:
            self.model.vocab_size = tokenizer.vocab_size
        if self.model.mask_id < 0:
            if tokenizer.mask_id is None:
                raise ConfigError(f"data.tokenizer: {self.data.tokenizer!r} has no MASK token; set model.mask_id "
                                  "or use a tokenizer with one")
            self.model.mask_id = tokenizer.mask_id

    def resolve_epochs(self, train_sequences: int) -> str | None:
        """train.epochs -> train.max_steps from the number of training sequences; the log line (None
        when the recipe counts steps)."""
        t = self.train
        if t.epochs is None:
            return None
        t.max_steps = max(1, math.ceil(t.epochs * train_sequences / t.global_batch))
        return (f"train.epochs {t.epochs:g} x {train_sequences:,} training sequences / global batch {t.global_batch} "
                f"-> train.max_steps {t.max_steps:,}")

    def dp_size(self, world_size: int) -> int:
        """Data-parallel replicas that read different samples: world / (tp * cp * pp). The ranks of one
        context-parallel group read the same samples (each its own slice of every sequence); gradients
        and ZeRO partitions are reduced over dp * cp ranks (pretrain/parallel.py)."""
        p = self.parallel
        return world_size // (p.tp * p.cp * p.pp)

    def grad_accum(self, world_size: int) -> int:
        return self.train.global_batch // (self.train.micro_batch * self.dp_size(world_size))


_CLASSES = {"run": RunConfig, "model": ModelConfig, "objective": ObjectiveConfig, "data": DataConfig,
            "train": TrainConfig, "parallel": ParallelConfig, "logging": LoggingConfig}

_NULL_TEXT = ("", "null", "~")


def parse_overrides(items: list[str]) -> dict:
    """`section.key=value` items -> {section: {key: value}}. Values are YAML (`1e-3`, `true`, `[1, 2]`);
    a string field takes the text as written (`run.name=12345`, `train.sample_prompt=a: b`)."""
    out: dict = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected section.key=value (for example train.max_steps=10)")
        key, value = item.split("=", 1)
        section_name, name = key.split(".", 1)
        cls = _CLASSES.get(section_name)
        if cls is not None and annotation_is_text(cls, name):
            parsed = None if annotation_is_nullable(cls, name) and value in _NULL_TEXT else value
        elif value == "":
            parsed = None
        else:
            try:
                parsed = parse_value(value)
            except yaml.YAMLError:
                raise ConfigError(f"{key}: {value!r} is not a YAML value") from None
        out.setdefault(section_name, {})[name] = parsed
    return out


def _merge(base: dict, extra: dict) -> dict:
    """`extra`'s keys over `base`'s, per section; a dotted key (`train.lora.rank=4`) sets one key of a
    nested mapping (`lora`), keeping its other keys."""
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section_name, values in extra.items():
        current = merged.get(section_name)
        out = dict(current if isinstance(current, dict) else {})
        for key, value in values.items():
            if "." in key:
                head, tail = key.split(".", 1)
                inner = out.get(head)
                out[head] = {**(inner if isinstance(inner, dict) else {}), tail: value}
            else:
                out[key] = value
        merged[section_name] = out
    return merged


def _one_length(raw: dict, overrides: dict) -> None:
    """train.epochs and train.max_steps are two ways to say how long: a command-line override of one
    replaces the recipe file's other; both in the same place is an error."""
    over = overrides.get("train") or {}
    train = raw.get("train")
    if not isinstance(train, dict):
        return
    for given, other in (("epochs", "max_steps"), ("max_steps", "epochs")):
        if over.get(given) is not None and other not in over:
            train.pop(other, None)
    if train.get("epochs") is not None and train.get("max_steps") is not None:
        raise ConfigError(f"train.epochs: set either train.epochs ({train['epochs']}) or train.max_steps "
                          f"({train['max_steps']}), not both")


def from_dict(raw: dict) -> RecipeConfig:
    """Sections from a mapping (a recipe file, or the `config` of a checkpoint's meta.json)."""
    raw = dict(raw or {})
    unknown = [k for k in raw if k not in _CLASSES]
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown config section; valid sections: {', '.join(_CLASSES)}")
    sections, given = {}, set()
    for name, cls in _CLASSES.items():
        values = raw.get(name)
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{name}: must be a mapping of keys (see setdlm pretrain --describe {name}), got {values!r}")
        if name == "model":
            values = apply_preset(values)
        check_keys(cls, name, values)
        sections[name] = cls(**values)
        given.update(f"{name}.{k}" for k in values)
    cfg = RecipeConfig(**sections)
    cfg._given = frozenset(given)  # RecipeConfig.given: what the recipe wrote (not a field: not saved)
    return cfg


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None,
                require: tuple[str, ...] = REQUIRED_SECTIONS) -> RecipeConfig:
    """A recipe file plus overrides -> a validated RecipeConfig (layout checks needing the world size
    and vocabulary checks needing the tokenizer come later, in RecipeConfig.validate)."""
    raw: dict = {}
    if path is not None:
        raw = load_yaml(path, "--config")
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"--config: {path} does not hold a mapping of sections (run, model, objective, data, train, ...)")
    parsed = parse_overrides(overrides or [])
    merged = _merge(raw, parsed)
    _one_length(merged, parsed)
    missing = [s for s in require if not merged.get(s)]
    if path is not None and missing:
        raise ConfigError(f"--config: {path} does not set the section{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(missing)}; a recipe needs {', '.join(require)} (start from configs/quickstart.yaml; "
                          "setdlm pretrain --describe lists every key)")
    cfg = from_dict(merged)
    cfg.validate(world_size=None, need_vocab=False)
    return cfg


def save_config(cfg: RecipeConfig, path: str | os.PathLike) -> None:
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
