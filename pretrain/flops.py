"""FLOPs per training step, MFU and HFU, counting the attention work each objective's mask allows.

Matmul FLOPs only (2 per multiply-add), forward + backward = 3x forward:

* linear layers: 2 x (QKV + output projection + MLP) weights per token and layer, on every token the
  model forwards (2L for the two-stream objectives), plus the output head on the predicted tokens
  only (`logits_slice`: L - 1 for AR, L otherwise);
* attention: 4 x heads x head_dim per allowed (query, key) pair and layer (scores QK^T and the
  weighted sum PV). The allowed pairs are those of the static mask (model/masks.py), counted in
  closed form (`attention_pairs`, checked against the masks in the tests):

      causal (AR)           L (L + 1) / 2
      bidirectional (MDLM)  L^2
      set_causal (SW-SetDLM, 2L tokens)      L^2 + L     (clean: L (L+1)/2 causal; queries: L (L-1)/2 earlier clean + themselves)
      block_diffusion (BD3-LM, 2L tokens)    L^2 + L B   (noisy: own block + earlier clean blocks; clean: block-causal)

  so a SetDLM step's attention costs about two causal attentions, not a dense (2L)^2 one, and MFU
  compares objectives fairly. A dense kernel (SDPA on CPU) computes every pair and does more work than
  counted; flex attention skips fully masked tiles and comes close to the count. Key padding is not
  subtracted (the data are packed).

Under `train.lora` the frozen weights need no weight gradient: their matmuls cost forward + input
gradient (2x forward), and the adapters' own matmuls (2 per adapter weight per token) cost 3x.

*Model* FLOPs count the work the step needs; *hardware* FLOPs add what activation checkpointing
recomputes (Megatron-LM's and PaLM's MFU vs HFU): `full` one more forward of the blocks, `selective`
the attention core's forward (the activation function is not a matmul). `perf/mfu` and `perf/hfu` divide
them by the device peak: `train.peak_tflops` when the recipe sets it, else the detected GPU's datasheet
bf16 dense peak from the table below (`device_peak_tflops`); on CPU or an unknown GPU MFU is N/A.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.schema import ConfigError
from model import families
from model.masks import MASK_KINDS
from model.shapes import matmul_params_per_layer

# Datasheet dense (no sparsity) bf16 tensor-core peak TFLOP/s per device, matched as a substring of
# `torch.cuda.get_device_name()`, the longest key first ("H100 PCIe" before "H100", the SXM part).
PEAK_TFLOPS = {"H100": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.0, "GH200": 989.0,
               "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def attention_pairs(kind: str, length: int, block_size: int = 0) -> int:
    """Allowed (query, key) pairs of the static mask `kind` over `length` = L (model/masks.py)."""
    L = int(length)
    if kind == "causal":
        return L * (L + 1) // 2
    if kind == "bidirectional":
        return L * L
    if kind == "set_causal":
        return L * L + L
    if kind == "block_diffusion":
        if block_size < 1 or L % block_size:
            raise ConfigError(f"objective.block_size: block size {block_size} must divide length {L}")
        return L * L + L * block_size
    raise ValueError(f"unknown mask kind {kind!r}; valid: {', '.join(MASK_KINDS)}")


def linear_flops_per_token(model_cfg) -> float:
    """Forward matmul FLOPs of one token through one block's linear layers: 2 per weight of its matrix
    products (QKV, output projection, MLP; model/shapes.py reads them from the block)."""
    return 2.0 * matmul_params_per_layer(model_cfg)


def attention_flops(model_cfg, pairs: int) -> float:
    """Forward FLOPs of one block's attention over `pairs` allowed (query, key) pairs."""
    return 4 * model_cfg.n_heads * model_cfg.dim_head * pairs


@dataclass
class StepFlops:
    model: float  # per optimizer step, whole run
    hardware: float  # model + recomputation

    def metrics(self, steps_per_s: float, peak_tflops: float | None, world: int) -> dict:
        """perf/* metrics of the trainer: TFLOP/s per device, and MFU / HFU where the peak is known."""
        out = {"perf/model_tflops": self.model * steps_per_s / world / 1e12,
               "perf/mfu": self.model * steps_per_s / (peak_tflops * 1e12 * world) if peak_tflops else None}
        if self.hardware != self.model:
            out["perf/hardware_tflops"] = self.hardware * steps_per_s / world / 1e12
            out["perf/hfu"] = self.hardware * steps_per_s / (peak_tflops * 1e12 * world) if peak_tflops else None
        return out


def sequence_flops(model_cfg, objective_name: str, seq_len: int, block_size: int = 4, recompute: str = "none",
                   n_layers: int | None = None, head: bool = True) -> tuple[float, float]:
    """(matrix-product FLOPs, attention FLOPs) of one training sequence, forward + backward (+ what
    `recompute` adds), through `n_layers` blocks (default: all) and the output head when `head` (a
    pipeline stage's share: pretrain/steptime.py). Attention is the scores and weighted sum on the
    allowed pairs (`attention_flops`), the rest the linear layers and the head."""
    c = model_cfg
    lay = families.get(objective_name).layout(seq_len, block_size)
    t_in, t_out = lay.tokens_in, lay.tokens_out
    pairs = attention_pairs(lay.mask_kind, seq_len, lay.block_size)
    n = c.n_layers if n_layers is None else n_layers
    linear = n * linear_flops_per_token(c) * t_in
    matmul = 3.0 * (linear + (2 * c.hidden * c.padded_vocab_size * t_out if head else 0.0))
    attention = 3.0 * n * attention_flops(c, pairs)
    if recompute == "full":
        matmul += linear
    if recompute in ("full", "selective"):
        attention += n * attention_flops(c, pairs)
    return matmul, attention


def train_step_flops(model_cfg, objective_name: str, seq_len: int, sequences: int, block_size: int = 4,
                     recompute: str = "none", adapters_per_layer: int | None = None) -> float:
    """Model FLOPs of one optimizer step over `sequences` sequences (hardware FLOPs with `recompute`);
    `adapters_per_layer` (LoRA adapter weights of one block): the other weights are frozen."""
    c = model_cfg
    lay = families.get(objective_name).layout(seq_len, block_size)
    t_in, t_out = lay.tokens_in, lay.tokens_out
    per_seq = sum(sequence_flops(c, objective_name, seq_len, block_size, recompute))
    if adapters_per_layer is not None:  # no weight gradients of the frozen matmuls; the adapters' own work
        per_seq -= c.n_layers * linear_flops_per_token(c) * t_in + 2 * c.hidden * c.padded_vocab_size * t_out
        adapters = c.n_layers * 2.0 * adapters_per_layer * t_in
        per_seq += 3.0 * adapters + (adapters if recompute == "full" else 0.0)
    return sequences * per_seq


def step_flops(cfg) -> StepFlops:
    """Model and hardware FLOPs of one optimizer step of recipe `cfg`."""
    lora, adapters = getattr(cfg.train, "lora", None), None
    if lora is not None:
        from model.lora import block_adapter_params

        adapters = sum(p.numel for p in block_adapter_params(cfg.model, rank=lora.rank, targets=lora.targets).values())
    args = (cfg.model, cfg.objective.name, cfg.data.seq_len, cfg.train.global_batch, cfg.objective.block_size)
    mode = getattr(cfg.train, "activation_checkpointing", "none")
    return StepFlops(model=train_step_flops(*args, adapters_per_layer=adapters),
                     hardware=train_step_flops(*args, recompute=mode, adapters_per_layer=adapters))


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The PEAK_TFLOPS entry of a CUDA device name (None: not in the table)."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_TFLOPS[key]
    return None


def device_peak_tflops(override: float = 0.0) -> float | None:
    """The peak that `perf/mfu` and `perf/hfu` divide by: `train.peak_tflops` when > 0 (e.g. a measured
    matmul rate, or another precision's peak), else the detected GPU's datasheet bf16 dense peak; None
    (MFU N/A) on CPU or a GPU the table does not know."""
    if override > 0:
        return float(override)
    if not torch.cuda.is_available():
        return None
    return datasheet_peak_tflops(torch.cuda.get_device_name())
