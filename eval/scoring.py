"""Scoring text with a model's likelihood bound: what `eval likelihood` and the scorer share.

`text_rows` frames token documents as training does and cuts them into rows; `score_rows` is the
objective's bound of a batch of rows (`prepare(bound=True)`, as `Trainer.validate` computes it);
`Scorer` is the generative-perplexity model of uncond and throughput (`--scorer`): a setdlm
checkpoint scored through `text_rows` + `score_rows`, or a transformers causal LM (`hf:NAME`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from .featurize import load_hf
from .models import Checkpoint


def autocast(precision: str, device: torch.device):
    """Evaluation's precision: bf16 autocast when `precision` is bf16, or auto on a CUDA device with bf16
    (the trainer casts its weights to bf16 through DeepSpeed instead and uses no autocast)."""
    p = precision
    if p == "auto":
        p = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if p == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()




def text_rows(docs_ids, tok, packing: str, seq_len: int) -> dict:
    """Token documents framed as in training (`packing`), concatenated and cut into rows of `seq_len`,
    the last row padded: {"input_ids", "valid_mask", "sample_id"} (CPU tensors)."""
    import numpy as np

    from data_pipeline.packing import frame_documents, token_dtype

    flat, _ = frame_documents(docs_ids, packing, tok.bos_id, tok.eos_id, token_dtype(tok.vocab_size))
    n = math.ceil(len(flat) / seq_len)
    rows = np.zeros((n, seq_len), dtype=np.int64)
    valid = np.zeros((n, seq_len), dtype=bool)
    rows.flat[: len(flat)] = flat
    valid.flat[: len(flat)] = True
    return {"input_ids": torch.from_numpy(rows), "valid_mask": torch.from_numpy(valid), "sample_id": torch.arange(n)}


@torch.no_grad()
def score_rows(model, cfg, batch: dict, gen: torch.Generator, precision: str | None = None) -> tuple[float, int]:
    """(summed NLL bound in nats, scored tokens) of a batch of rows under `model` with recipe `cfg`:
    the objective's bound draw (`prepare(bound=True)`), as Trainer.validate and this task compute it."""
    from model.objectives import build_objective

    device = next(model.parameters()).device
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    if "valid_mask" in batch and bool(batch["valid_mask"].all()):
        batch.pop("valid_mask")
    obj = build_objective(cfg.objective, cfg.model, batch["input_ids"].shape[1])
    inputs = obj.prepare(batch, gen, bound=True)
    with autocast(precision or cfg.train.precision, device):
        logits = model(inputs.input_ids, inputs.position_ids, inputs.attn_mask, logits_slice=inputs.logits_slice)
    _, m = obj.loss(logits, inputs)
    return float(m["nll_sum"]), int(round(float(m["nll_tokens"])))


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
        return {"scorer": str(c.path), "scorer_step": c.meta.get("step"), "scorer_objective": c.objective,
                "exact": c.cfg.objective.family.exact_likelihood, "estimator": c.cfg.objective.family.estimator,
                "framing": c.cfg.data.packing, "rows_of": c.cfg.data.seq_len, "ema": c.uses_ema}

    def _load(self):
        if self._loaded:
            return
        if self._hf:
            from transformers import AutoModelForCausalLM

            self.tok, self.lm = load_hf(self.spec[3:], AutoModelForCausalLM, self.device, "--scorer",
                                        "offline, give a local directory or a setdlm checkpoint")
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
        """Through the code path of `eval likelihood --text` (score_rows)."""
        if not ids:
            return 0.0, 0
        cfg = self.ckpt.cfg
        batch = text_rows([ids], self.tok, cfg.data.packing, cfg.data.seq_len)
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        nll, tokens = score_rows(self.lm, cfg, batch, gen)
        return nll, tokens
