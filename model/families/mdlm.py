"""MDLM: masked diffusion. Bidirectional attention over L tokens; decoding unmasks the span in a number
of steps and re-reads the whole sequence every step (no KV cache)."""

from __future__ import annotations

from common.schema import ConfigError

from .spec import FamilySpec


class MaskedDiffusionFamily(FamilySpec):
    name = "mdlm"
    title = "MDLM"
    description = "masked diffusion (MDLM)"
    objective_path = "model.objectives.mdlm:MaskedDiffusionObjective"
    decoder_path = "model.sampling.mdlm:MDLMDecoder"
    mask_kind = "bidirectional"
    inference_mask = "bidirectional"
    decoding = "full_sequence"
    clean_text_mask = "bidirectional"
    objective_keys = ("eps", "antithetic")
    bound = "NELBO"
    estimator = "NELBO, exact discrete form (k ~ U{1..n} masked, weight n/k)"
    bound_masks_subset = True
    compiled_decode = False
    reference_names = ("mdlm",)

    def validate(self, objective, seq_len: int) -> None:
        if not 0.0 < objective.eps < 1.0:
            raise ConfigError(f"objective.eps: must be in (0, 1), got {objective.eps}")

    def card_rows(self, schedule: dict) -> list:
        return [("noise eps", schedule.get("eps"))]


SPEC = MaskedDiffusionFamily()
