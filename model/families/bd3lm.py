"""BD3-LM: block diffusion. Noisy blocks x_t attend inside their block and to the clean earlier blocks
(a two-stream layout of 2L tokens); decoding denoises one block at a time with a KV cache per
completed block."""

from __future__ import annotations

from common.schema import ConfigError

from .spec import FamilySpec


class BlockDiffusionFamily(FamilySpec):
    name = "bd3lm"
    title = "BD3-LM"
    description = "block diffusion (BD3-LM)"
    objective_path = "model.objectives.bd3lm:BlockDiffusionObjective"
    decoder_path = "model.sampling.bd3lm:BD3LMDecoder"
    mask_kind = "block_diffusion"
    inference_mask = "block_causal"
    decoding = "block"
    two_stream = True
    blocked_mask = True
    objective_keys = ("block_size", "eps", "antithetic")
    bound = "NELBO"
    estimator = "NELBO per block, exact discrete form (k ~ U{1..B} masked, weight B/k)"
    bound_masks_subset = True
    reference_step = "bd3lm_step"
    reference_names = ("bd3lm",)

    def validate(self, objective, seq_len: int) -> None:
        if objective.block_size < 1 or seq_len % objective.block_size:
            raise ConfigError(f"objective.block_size: block size {objective.block_size} must divide seq_len={seq_len}")
        if not 0.0 < objective.eps < 1.0:
            raise ConfigError(f"objective.eps: must be in (0, 1), got {objective.eps}")

    def settings_line(self, cfg) -> str:
        return f"{self.name} sampler, block size {cfg.block_size}"

    def schedule_fields(self, objective, seq_len: int) -> dict:
        return {"set_size": int(objective.block_size)}

    def card_rows(self, schedule: dict) -> list:
        return [("block size", schedule.get("block_size")), ("noise eps", schedule.get("eps"))]


SPEC = BlockDiffusionFamily()
