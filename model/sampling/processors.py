"""Logits processors and token choice, vectorised over [B, N, V] (no host reads).

Order: logit bias -> repetition penalty -> presence and frequency penalties (`adjust`) -> (greedy)
argmax, or temperature -> top-k -> top-p -> sample. The confidence of a position is the probability
of its chosen token: under softmax(adjusted logits) when greedy, under the processed (tempered,
truncated, renormalised) distribution when sampling. Log-probabilities (`token_logprobs`) are those of
the adjusted logits, before temperature and truncation. MASK and vocabulary padding are already -inf
in the model's logits and stay impossible.

Floors keep every number finite (config.py): a temperature below `TEMPERATURE_FLOOR` decodes greedily
(`cfg.greedy`: the limit of sampling as the temperature goes to 0; dividing float32 logits by 1e-300
gives inf and NaN), and the repetition penalty is bounded to `REPETITION_PENALTY_RANGE` (SamplingConfig
refuses other values, naming the field): within it, a logit divided or multiplied by the penalty,
then divided by a temperature at the floor, stays finite for any logit below 1e27 in magnitude.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def presence(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, L] token ids (ids >= vocab ignored) -> [B, vocab] bool: which tokens occur in each row."""
    out = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.bool, device=tokens.device)
    out.scatter_(1, tokens.clamp(max=vocab), True)
    return out[:, :vocab]


def repetition_penalty(logits: torch.Tensor, present: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL / Hugging Face rule: tokens already present get positive logits divided by `penalty` and
    negative ones multiplied by it. logits [B, N, V], present [B, V]."""
    if penalty == 1.0:
        return logits
    pen = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(present[:, None, :], pen, logits)


def counts(tokens: torch.Tensor, keep: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, L] token ids, [B, L] which of them count -> [B, vocab] float: occurrences of each token."""
    ids = torch.where(keep, tokens, torch.full_like(tokens, vocab)).clamp(max=vocab)
    out = torch.zeros(tokens.shape[0], vocab + 1, device=tokens.device)
    out.scatter_add_(1, ids, torch.ones_like(ids, dtype=out.dtype))
    return out[:, :vocab]


def bias_vector(bias: dict[int, float], vocab: int, device) -> torch.Tensor | None:
    """OpenAI's logit_bias {token id: value} as a dense [vocab] tensor (None when empty)."""
    if not bias:
        return None
    out = torch.zeros(vocab, device=device)
    ids = torch.tensor([int(t) for t in bias], dtype=torch.long)
    if int(ids.max()) >= vocab:
        from .config import SamplingError

        raise SamplingError(f"sampling.logit_bias: token id {int(ids.max())} is outside the vocabulary of {vocab}")
    out[ids.to(device)] = torch.tensor([float(v) for v in bias.values()], device=device)
    return out


def adjust(logits: torch.Tensor, cfg, present: torch.Tensor | None = None, seen: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, N, V] float -> the step's distribution before temperature: + logit bias [V], the
    repetition penalty on tokens `present` [B, V], then OpenAI's penalties on the output's own tokens
    (`seen` [B, V] counts): - frequency_penalty * count - presence_penalty * (count > 0)."""
    if bias is not None:
        logits = logits + bias
    if present is not None and cfg.repetition_penalty != 1.0:
        logits = repetition_penalty(logits, present, cfg.repetition_penalty)
    if seen is not None and (cfg.frequency_penalty or cfg.presence_penalty):
        logits = logits - (cfg.frequency_penalty * seen + cfg.presence_penalty * (seen > 0))[:, None, :]
    return logits


def token_logprobs(logits: torch.Tensor, tok: torch.Tensor, k: int):
    """Adjusted logits [B, N, V] and chosen tokens [B, N] -> (log-probability of each chosen token
    [B, N], the k most likely tokens [B, N, k] and their log-probabilities [B, N, k])."""
    lp = logits.log_softmax(-1)
    top = lp.topk(k, dim=-1) if k else None
    chosen = lp.gather(-1, tok[..., None])[..., 0]
    if top is None:
        return chosen, tok.new_zeros(*tok.shape, 0), lp.new_zeros(*tok.shape, 0)
    return chosen, top.indices, top.values


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose mass reaches p (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
    drop_sorted = before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def choose(logits: torch.Tensor, cfg, generator: torch.Generator | None = None,
           present: torch.Tensor | None = None, confidence: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, N, V] (float) -> (tokens [B, N] long, confidence [B, N] float; None when greedy and
    `confidence` is False: AR needs only the token)."""
    logits = adjust(logits.float(), cfg, present)
    if cfg.greedy:  # probability of the argmax without materialising the softmax: 1 / sum exp(logits - max)
        top, tok = logits.max(-1)
        if not confidence:
            return tok, None
        return tok, (logits - top[..., None]).exp_().sum(-1).reciprocal_()
    logits = logits / cfg.temperature
    logits = top_k_filter(logits, cfg.top_k)
    logits = top_p_filter(logits, cfg.top_p)
    probs = logits.softmax(-1)
    flat = probs.reshape(-1, probs.shape[-1])
    tok = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    conf = probs.gather(-1, tok[..., None])[..., 0]
    return tok, conf


def accepts_all(threshold: float | None) -> bool:
    """Threshold 0: every active position is accepted, whatever its confidence (so none is computed)."""
    return threshold is not None and threshold <= 0.0


def accept_top1(conf: torch.Tensor | None, active: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """SetDLM rule: the most confident active position plus every active one with conf >= threshold.

    conf, active [B, N]. Rows without an active position accept nothing. threshold None or >= 1:
    exactly one per row (even where probabilities saturate at 1.0 in floating point). threshold 0:
    every active one (`conf` is not read; it may be None)."""
    if accepts_all(threshold):
        return active.clone()
    masked = conf.masked_fill(~active, -1.0)
    best = masked.argmax(-1, keepdim=True)
    accept = torch.zeros_like(active).scatter_(1, best, True) & active
    if threshold is not None and threshold < 1.0:
        accept |= active & (conf >= threshold)
    return accept


def accept_top_k(conf: torch.Tensor | None, active: torch.Tensor, k: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """Block/masked diffusion rule: the k[b] most confident active positions of each row (ties by
    lower index) plus every active one with conf >= threshold. conf, active [B, N], k [B] long.
    threshold 0: every active one (`conf` is not read; it may be None)."""
    if accepts_all(threshold):
        return active.clone()
    masked = conf.masked_fill(~active, -1.0)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    accept = active & (rank < k[:, None])
    if threshold is not None and threshold < 1.0:
        accept |= active & (conf >= threshold)
    return accept
