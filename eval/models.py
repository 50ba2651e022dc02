"""Checkpoints and predictors: what the tasks call to generate or score text.

`Checkpoint` reads a run directory lazily (config and tokenizer first, the weights only when a unit
needs them, so a rank whose units are all done never loads the model). `ModelPredictor` wraps
`model.sampling.generate` for prompts (completion) and masked spans (infilling) and returns plain
dicts that go into the per-example records. Tests (and users scoring other systems) can pass any
object with the same two methods. (The decoding options and their SamplingConfig: eval/options.py;
the scorer: eval/scoring.py.)
"""

from __future__ import annotations

import dataclasses
import time

import torch

from model import families

from .errors import EvalError


def pick_device(local_rank: int = 0, device: str | None = None) -> torch.device:
    if device and device != "cuda":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device("cpu")


class Checkpoint:
    """A saved run or checkpoint folder: recipe config, tokenizer, and (lazily) the model."""

    def __init__(self, path: str, *, ema: bool = True, device: torch.device | str = "cpu"):
        from pretrain.checkpoint import rundir

        if not path:
            raise EvalError("--checkpoint: required (a run directory or one of its checkpoints/step_* folders)")
        try:
            self.path = rundir.resolve_checkpoint(path)
            self.meta = rundir.read_meta(self.path)
            self.cfg = rundir.read_recipe(self.path, self.meta)
        except ValueError as e:  # CheckpointError: a missing or damaged checkpoint
            raise EvalError(f"--checkpoint: {e}") from None
        self.ema, self.device = ema, torch.device(device)
        self._model = None
        self._tokenizer = None

    @property
    def objective(self) -> str:
        return self.cfg.objective.name

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from pretrain.checkpoint import rundir

            try:
                self._tokenizer = rundir.checkpoint_tokenizer(self.path, self.meta, self.cfg.data.tokenizer)
            except ValueError as e:  # CheckpointError (another tokenizer) and TokenizerError
                raise EvalError(f"--checkpoint: {e}") from None
        return self._tokenizer

    @property
    def model(self):
        if self._model is None:
            from pretrain.checkpoint.inference import load_model

            try:
                self._model, tok, cfg = load_model(self.path, ema=self.ema, device=self.device)
            except ValueError as e:  # CheckpointError (refused, damaged, incomplete files) and tokenizer errors
                raise EvalError(f"--checkpoint: {e}") from None
            self._tokenizer = self._tokenizer or tok
        return self._model

    @property
    def has_ema(self) -> bool:
        """Whether the checkpoint holds EMA weights (any checkpoint format: pretrain/checkpoint/rundir.py)."""
        from pretrain.checkpoint.rundir import has_ema

        return has_ema(self.path, self.meta)

    @property
    def uses_ema(self) -> bool:
        """EMA weights are what the model is evaluated with (asked for, and present)."""
        return self.ema and self.has_ema

    def describe(self) -> dict:
        """What identifies the weights (goes into run.json: a restart on other weights is refused).
        `ema` is what is used: True only when EMA weights were asked for and the checkpoint has them."""
        return {"path": str(self.path), "step": self.meta.get("step"), "objective": self.objective,
                "tokenizer": self.meta.get("tokenizer"), "tokenizer_sha256": (self.meta.get("tokenizer_sha256") or "")[:16],
                "ema": self.uses_ema, "ema_requested": self.ema, "seq_len": self.cfg.data.seq_len,
                "max_seq_len": self.cfg.model.max_seq_len}


# ------------------------------------------------------------------------------------------ sampling
def sampling_spec(sc) -> dict:
    d = dataclasses.asdict(sc)
    d.pop("check_every", None)
    d.pop("compact", None)
    return d


def _out_dict(o, seconds: float | None = None) -> dict:
    return {"text": o.text, "tokens": list(o.tokens), "n_tokens": len(o.tokens), "steps": o.steps,
            "tokens_per_step": o.tokens_per_step, "seconds": o.seconds if seconds is None else seconds,
            "stop_reason": o.stop_reason}


def prompt_budget(max_seq_len: int, max_new_tokens: int, *, min_prompt: int = 1) -> int:
    """Prompt tokens that fit beside `max_new_tokens` in `max_seq_len`; EvalError when fewer than
    `min_prompt` (checked by the tasks before the model loads)."""
    budget = int(max_seq_len) - int(max_new_tokens)
    if budget < min_prompt:
        need = f"at most {int(max_seq_len) - min_prompt}" if min_prompt else f"at most {int(max_seq_len)}"
        raise EvalError(f"--max-new-tokens: {max_new_tokens} leaves no room for a prompt in the model's max_seq_len "
                        f"{max_seq_len}; valid: {need}")
    return budget


def prompt_limit(max_seq_len: int, max_new_tokens: int, family: str, overflow: bool) -> int:
    """Prompt tokens a decoding can take: with `overflow` the cached families (SW-SetDLM, BD3-LM, AR)
    decode past max_seq_len by dropping the oldest cache entries (model/sampling/engine.py), so the
    prompt needs only to fit its prefill; otherwise (and always for MDLM, which re-reads the whole
    sequence) it must fit beside the new tokens (EvalError naming the budget when nothing fits)."""
    if overflow and not families.get(family, "sampling.family").rereads_sequence:
        return int(max_seq_len)
    return prompt_budget(max_seq_len, max_new_tokens, min_prompt=0)


class ModelPredictor:
    """Generation from a checkpoint with one SamplingConfig; `overflow`: see `prompt_limit`."""

    def __init__(self, ckpt: Checkpoint, sampling, overflow: bool = False):
        self.ckpt, self.sampling, self.overflow = ckpt, sampling, overflow

    def _generate(self, prompts, seed: int, **overrides):
        from model.sampling import generate

        model = self.ckpt.model
        dev = next(model.parameters()).device
        gen = torch.Generator(device=dev).manual_seed(int(seed))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        outs = generate(model, prompts, self.sampling, tokenizer=self.ckpt.tokenizer, generator=gen, **overrides)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return outs, time.perf_counter() - t0

    @property
    def tokenizer(self):
        return self.ckpt.tokenizer

    def complete(self, prompts: list, seed: int, examples=None, **overrides) -> list[dict]:
        """Continue each prompt (text or token ids); stops per the SamplingConfig (EOS, stop strings)
        and the `overrides` (e.g. stop=[...]). `examples` is unused here (oracles in tests use it)."""
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        ar_start = int(self.sampling.spec.next_token and any(not p for p in ids))  # AR starts an empty prompt at EOS
        budget = prompt_limit(self.ckpt.cfg.model.max_seq_len, overrides.get("max_new_tokens", self.sampling.max_new_tokens),
                              overrides.get("family", self.sampling.family), self.overflow) - ar_start
        cut = [max(0, len(p) - budget) for p in ids]
        ids = [p[c:] for p, c in zip(ids, cut)]  # keep the end of over-long prompts (as lm-eval does)
        outs, wall = self._generate(ids, seed, **overrides)
        return [dict(_out_dict(o), batch_seconds=wall, prompt_tokens=len(p), prompt_cut=c)
                for o, p, c in zip(outs, ids, cut)]

    def infill(self, parts: list[tuple[list[int], int, list[int]]], seed: int, examples=None, **overrides) -> list[dict]:
        """Fill `length` masked tokens between prefix and suffix (token ids) for each part."""
        from model.sampling import Infill

        outs, wall = self._generate([Infill(list(a), int(n), list(b)) for a, n, b in parts], seed, **overrides)
        return [dict(_out_dict(o), batch_seconds=wall, prompt_tokens=len(a) + len(b)) for o, (a, _, b) in zip(outs, parts)]

    def warmup(self, prompts, n: int, seed: int = 0) -> None:
        for i in range(n):
            self._generate([list(prompts[i % len(prompts)])], seed + i)
