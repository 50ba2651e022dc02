"""What every objective shares: the model-input bundle and the (vocab-parallel) loss."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import families
from ..context_parallel import RankLayout
from ..layers import vocab_cross_entropy
from ..masks import MaskSpec, build_mask, with_key_padding


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T] original positions (rotary phases)
    attn_mask: torch.Tensor  # [T, T] or [B, 1, T, T], True = attend
    logits_slice: slice  # which of the T outputs are predictions
    targets: torch.Tensor  # [B, N] token to predict at each output
    loss_weight: torch.Tensor  # [B, N] training-loss weight (0 = not predicted)
    nll_weight: torch.Tensor  # [B, N] weight of each token's CE in the NLL bound (prepare(bound=True) only)
    num_tokens: torch.Tensor  # scalar: tokens the NLL bound is normalised by
    mask_spec: MaskSpec | None = None  # the static mask by name (None when per-row padding applies)
    extra: dict = field(default_factory=dict)
    # Training: the factor that turns this micro-batch's summed CE into its share of the step's loss
    # (pretrain/pipeline.py: global token normalisation); None: the micro-batch's own mean.
    loss_scale: torch.Tensor | float | None = None
    # Context parallelism: this rank's part of the sequence (None: the whole sequence, one process)
    context: RankLayout | None = None

    def model_kwargs(self) -> dict:
        """Keyword arguments of Transformer.forward besides input_ids and position_ids."""
        kw = {"attn_mask": self.attn_mask, "logits_slice": self.logits_slice, "mask_spec": self.mask_spec}
        if self.context is not None:
            kw["context"] = self.context
        return kw


class Objective:
    """Turns clean sequences into model inputs, and logits into a loss and metrics. `name` and
    `mask_kind` are those of the objective config's family (model/families)."""

    def __init__(self, cfg, model_cfg, seq_len: int, cross_entropy=None):
        self.cfg, self.model_cfg, self.seq_len = cfg, model_cfg, seq_len
        self.family = families.get(cfg.name)
        self.name, self.mask_kind = self.family.name, self.family.mask_kind
        self.mask_id = model_cfg.mask_id
        # per-token CE of the logits the model returns: over the full vocabulary by default; a
        # tensor-parallel model's own (`model.tp.cross_entropy`) for its vocabulary slices
        self.cross_entropy = cross_entropy or vocab_cross_entropy
        # the model's `ContextParallel` (model/context_parallel.py) when a sequence is split over CP
        # ranks: `prepare` then returns this rank's part of it (`for_rank`)
        self.context = None

    # Subclasses implement prepare(). bound=False: the training draw (loss_weight; variance
    # reductions allowed, nll_weight may be zero). bound=True: the draw whose nll_weight-weighted CE
    # is an unbiased estimate of the NLL bound (val/nll, eval likelihood, the scorer).
    def prepare(self, batch: dict, generator: torch.Generator | None = None, bound: bool = False) -> ModelInputs:
        raise NotImplementedError

    def for_rank(self, inputs: ModelInputs) -> ModelInputs:
        """This CP rank's part of a prepared batch (the whole of it without context parallelism).

        The batch was prepared whole (orders and noise are per-sample draws: every rank draws the same
        sample's and keeps its slice, model/noise.py). The rank keeps its head-tail chunks of every
        stream (model/context_parallel.py): their tokens and per-token rotary positions, the rank-local
        mask, and the outputs of its tokens in the predicted stream with their targets and weights
        (a token whose full-sequence output is not a prediction, AR's last, gets weight 0). `num_tokens`
        (the NLL's normaliser, a per-sequence count) is carried by CP rank 0, so sums over the ranks are
        the whole batch's; `extra` keeps the whole batch's draws."""
        cp = self.context
        if cp is None or cp.size == 1:
            return inputs
        L = self.seq_len
        block = int(self.cfg.block_size) if self.family.blocked_mask else 0
        layout = RankLayout(self.mask_kind, L, cp.size, cp.rank, block)
        dev = inputs.input_ids.device
        rows, pos = layout.token_index().to(dev), layout.positions().to(dev)
        out_stream = inputs.logits_slice.start // L  # the stream whose tokens are predictions
        n_out = inputs.targets.shape[1]
        keep = pos < n_out
        at = pos.clamp(max=n_out - 1)

        def outputs(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(1, at) * keep if t.is_floating_point() else t.index_select(1, at)

        mask = inputs.attn_mask
        mask = layout.mask(dev) if mask.dim() == 2 else layout.slice_mask(mask)
        return ModelInputs(
            input_ids=inputs.input_ids.index_select(1, rows), position_ids=inputs.position_ids.index_select(1, rows),
            attn_mask=mask, logits_slice=slice(out_stream * layout.local, (out_stream + 1) * layout.local),
            targets=outputs(inputs.targets), loss_weight=outputs(inputs.loss_weight),
            nll_weight=outputs(inputs.nll_weight),
            num_tokens=inputs.num_tokens if cp.rank == 0 else torch.zeros_like(inputs.num_tokens),
            mask_spec=inputs.mask_spec, extra=inputs.extra, loss_scale=inputs.loss_scale, context=layout)

    @staticmethod
    def _batch_masks(batch: dict):
        x = batch["input_ids"]
        valid = batch.get("valid_mask")
        valid = torch.ones_like(x, dtype=torch.bool) if valid is None else valid.bool()
        context = batch.get("context_mask")
        context = torch.zeros_like(x, dtype=torch.bool) if context is None else context.bool() & valid
        pad = batch.get("pad_row")
        if pad is not None:  # filler rows of a padded validation batch: all given, nothing predicted or counted
            context = context | (pad.bool()[:, None] & valid)
        return x, valid, context

    def mask(self, kind: str, length: int, device, key_valid=None, block_size: int = 0):
        return with_key_padding(build_mask(kind, length, block_size, device), key_valid)

    def loss(self, logits: torch.Tensor, inputs: ModelInputs) -> tuple[torch.Tensor, dict]:
        """logits: vocab-parallel [B, N, V/tp]. Returns (training loss, summed metrics).

        The loss is the weighted CE sum times `inputs.loss_scale` (set per optimizer step so that the
        step's gradient is that of the CE summed over the global batch / its predicted-token count),
        or the micro-batch's own weighted mean when no scale is set. Metrics are sums: `loss_sum` /
        `loss_count` is the token-weighted mean CE of whatever was summed."""
        if self.cross_entropy is vocab_cross_entropy and logits.size(-1) < self.model_cfg.vocab_size:
            raise RuntimeError(f"objective loss: logits of {logits.size(-1)} columns for a vocabulary of "
                               f"{self.model_cfg.vocab_size}: a vocab-split model needs its own cross_entropy")
        ce = self.cross_entropy(logits.float(), inputs.targets)
        lw, nw = inputs.loss_weight, inputs.nll_weight
        count = lw.sum()
        total = (ce * lw).sum()
        loss = total * inputs.loss_scale if inputs.loss_scale is not None else total / count.clamp(min=1)
        metrics = {
            "loss_sum": total.detach(),
            "loss_count": count.detach().float(),
            "nll_sum": (ce.detach() * nw).sum(),
            "nll_tokens": inputs.num_tokens.detach().float(),
            "pred_tokens": count.detach().float(),
        }
        return loss, metrics


def summarize(metrics: dict) -> dict:
    """Summed metrics -> loss, nll (nats/token), bits per token, perplexity."""
    out = {}
    if metrics.get("loss_count", 0):
        out["loss"] = float(metrics["loss_sum"]) / float(metrics["loss_count"])
    if metrics.get("nll_tokens", 0):
        nll = float(metrics["nll_sum"]) / float(metrics["nll_tokens"])
        out.update(nll=nll, bpt=nll / math.log(2), ppl=math.exp(min(nll, 50.0)))
    return out
