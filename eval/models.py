"""Checkpoints and predictors: what the tasks call to generate or score text.

`Checkpoint` reads a run directory lazily (config and tokenizer first, the weights only when a unit
needs them, so a rank whose units are all done never loads the model). `ModelPredictor` wraps
`model.sampling.generate` for prompts (completion) and masked spans (infilling) and returns plain
dicts that go into the per-example records. Tests (and users scoring other systems) can pass any
object with the same two methods.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from .runner import EvalError


def pick_device(local_rank: int = 0, device: str | None = None) -> torch.device:
    if device and device != "cuda":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device("cpu")


class Checkpoint:
    """A saved run or checkpoint folder: recipe config, tokenizer, and (lazily) the model."""

    def __init__(self, path: str, *, ema: bool = True, device: torch.device | str = "cpu"):
        from pretrain.checkpoint import resolve_checkpoint

        if not path:
            raise EvalError("--checkpoint: required (a run directory or one of its checkpoints/step_* folders)")
        from pretrain.checkpoint import read_meta

        try:
            self.path = resolve_checkpoint(path)
            self.meta = read_meta(self.path)
        except (FileNotFoundError, RuntimeError, ValueError) as e:  # CheckpointError: a damaged checkpoint
            raise EvalError(f"--checkpoint: {e}") from None
        from pretrain.config import from_dict

        self.cfg = from_dict(self.meta["config"])
        self.ema, self.device = ema, torch.device(device)
        self._model = None
        self._tokenizer = None

    @property
    def objective(self) -> str:
        return self.cfg.objective.name

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from data_pipeline.tokenizers import load_tokenizer

            tok_dir = self.path.parent.parent / "tokenizer"
            self._tokenizer = load_tokenizer(str(tok_dir) if tok_dir.is_dir() else self.cfg.data.tokenizer)
            want = self.meta.get("tokenizer_sha256")
            if want and self._tokenizer.sha256 != want:
                raise EvalError(f"--checkpoint: {self.path}: its tokenizer (sha256 {self._tokenizer.sha256[:12]}) is "
                                f"not the one it was trained with ({want[:12]})")
        return self._tokenizer

    @property
    def model(self):
        if self._model is None:
            from pretrain.checkpoint import load_model

            try:
                self._model, tok, cfg = load_model(self.path, ema=self.ema, device=self.device)
            except ValueError as e:  # CheckpointError (refused, damaged, incomplete files) and tokenizer errors
                raise EvalError(f"--checkpoint: {e}") from None
            self._tokenizer = self._tokenizer or tok
        return self._model

    @property
    def has_ema(self) -> bool:
        """Whether the checkpoint holds EMA weights (an EMA file, or a consolidated state of a run with EMA)."""
        if any(self.path.glob("ema_mp_rank_*.pt")):
            return True
        return (self.path / "consolidated.pt").is_file() and bool(self.cfg.train.ema)

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
def add_sampling_args(p, *, threshold=None, max_new_tokens=128, temperature=0.0, window_default="D") -> None:
    g = p.add_argument_group("decoding (defaults follow the checkpoint's objective)")
    g.add_argument("--family", choices=["setdlm", "bd3lm", "mdlm", "ar"], help="sampler (default: the checkpoint's objective)")
    g.add_argument("--window", type=int, help=f"SW-SetDLM window w (default: {window_default})")
    g.add_argument("--threshold", type=float, default=threshold,
                   help=f"confidence threshold for extra tokens per step; 1 or more: none (default: {threshold})")
    g.add_argument("--block-size", type=int, help="BD3-LM block size (default: the objective's)")
    g.add_argument("--steps", type=int, help="MDLM denoising steps (default: one token per step)")
    g.add_argument("--steps-per-block", type=int, help="BD3-LM steps per block")
    g.add_argument("--remasking", choices=["confidence", "random"], default="confidence")
    g.add_argument("--temperature", type=float, default=temperature, help=f"0: greedy (default {temperature})")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"default {max_new_tokens}")
    g.add_argument("--batch-size", type=int, default=1, help="examples decoded together (default 1, as in the paper)")


def sampling_config(ckpt: Checkpoint, args, *, window: int | None = None, **extra):
    """SamplingConfig from the checkpoint's objective (w = D, its block size) and the CLI options."""
    from model.sampling import SamplingConfig

    o = ckpt.cfg.objective
    kw = dict(family=args.family or o.name, window=args.window or window or int(getattr(o, "set_size", 4) or 4),
              block_size=args.block_size or int(getattr(o, "block_size", 4) or 4), threshold=args.threshold,
              steps=args.steps, steps_per_block=args.steps_per_block, remasking=args.remasking,
              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens)
    kw.update(extra)
    sc = SamplingConfig(**kw)
    try:
        sc.validate()
    except ValueError as e:
        raise EvalError(f"--{str(e).split(':')[0].split('.')[-1].replace('_', '-')}: {e}") from None
    return sc


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


class ModelPredictor:
    """Generation from a checkpoint with one SamplingConfig."""

    def __init__(self, ckpt: Checkpoint, sampling):
        self.ckpt, self.sampling = ckpt, sampling

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
        ar_start = int(self.sampling.family == "ar" and any(not p for p in ids))  # AR starts an empty prompt at EOS
        budget = prompt_budget(self.ckpt.cfg.model.max_seq_len, overrides.get("max_new_tokens", self.sampling.max_new_tokens),
                               min_prompt=0) - ar_start
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


# ------------------------------------------------------------------------------------------ scoring
class Scorer:
    """Per-text NLL under a scoring model (generative perplexity).

    ``spec`` is a setdlm checkpoint (run dir or checkpoint folder) or ``hf:NAME_OR_DIR`` (a
    transformers causal LM, e.g. ``hf:gpt2-large`` as in the papers, online or from a local copy).
    Texts are re-tokenized with the scorer's tokenizer.

    - setdlm checkpoint: the same number `eval likelihood --text` computes for a file holding that one
      text -- the text framed as one training document (the recipe's packing: EOS after it, or
      [CLS]/[SEP] around it), cut into rows of the training ``data.seq_len`` (the last one padded),
      scored with the objective's bound (`prepare(bound=True)`: AR the exact NLL, SetDLM one sampled
      order, MDLM/BD3-LM the NELBO). The framing tokens are scored too; the first token of each row is
      context only for AR. A text scored alone has no neighbouring documents as context, so its NLL is
      somewhat higher than that of the same tokens inside packed validation rows.
    - ``hf:``: next-token NLL of the bare text (no framing; the first token is context only), in
      consecutive non-overlapping windows of the model's context.
    """

    def __init__(self, spec: str, device: torch.device):
        self.spec, self.device = spec, device
        self._hf = spec.startswith("hf:")
        self._loaded = False

    def describe(self) -> dict:
        if self._hf:
            return {"scorer": self.spec, "estimator": "next-token NLL (exact)"}
        c = Checkpoint(self.spec)
        from .tasks.likelihood import ESTIMATORS

        return {"scorer": str(c.path), "scorer_step": c.meta.get("step"), "scorer_objective": c.objective,
                "exact": c.objective == "ar", "estimator": ESTIMATORS.get(c.objective, ""),
                "framing": c.cfg.data.packing, "rows_of": c.cfg.data.seq_len, "ema": c.uses_ema}

    def _load(self):
        if self._loaded:
            return
        if self._hf:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            name = self.spec[3:]
            try:
                self.tok = AutoTokenizer.from_pretrained(name)
                self.lm = AutoModelForCausalLM.from_pretrained(name).to(self.device).eval()
            except OSError as e:
                raise EvalError(f"--scorer: cannot load {name!r} ({e}); offline, give a local directory or a setdlm "
                                f"checkpoint") from None
            self.max_len = int(getattr(self.lm.config, "n_positions", None) or getattr(self.lm.config, "max_position_embeddings", 1024))
        else:
            self.ckpt = Checkpoint(self.spec, device=self.device)
            self.lm = self.ckpt.model
            self.tok = self.ckpt.tokenizer
            self.max_len = int(self.ckpt.cfg.data.seq_len)
        self._loaded = True

    def encode(self, text: str) -> list[int]:
        self._load()
        return self.tok.encode(text) if not self._hf else self.tok(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def nll(self, text: str, seed: int = 0) -> tuple[float, int]:
        """(summed NLL in nats, number of scored tokens) of `text`; `seed` drives the bound's draws."""
        self._load()
        ids = self.encode(text)
        if not self._hf:
            return self._setdlm_nll(ids, seed)
        total, count = 0.0, 0
        for s in range(0, len(ids), self.max_len):
            win = ids[s:s + self.max_len]
            if len(win) < 2:
                continue
            x = torch.tensor([win], device=self.device)
            logits = self.lm(x).logits[0, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += len(win) - 1
        return total, count

    def _setdlm_nll(self, ids: list[int], seed: int) -> tuple[float, int]:
        """Through the code path of `eval likelihood --text` (eval.tasks.likelihood.score_rows)."""
        from .tasks.likelihood import score_rows, text_rows

        if not ids:
            return 0.0, 0
        cfg = self.ckpt.cfg
        batch = text_rows([ids], self.tok, cfg.data.packing, cfg.data.seq_len)
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        nll, tokens = score_rows(self.lm, cfg, batch, gen)
        return nll, tokens
