"""AR: autoregression. Causal attention over L tokens, next-token cross-entropy (an exact NLL);
decoding is cached next-token prediction. The only family a stock Hugging Face causal LM can hold."""

from __future__ import annotations

import re

from .spec import FamilySpec


class AutoregressiveFamily(FamilySpec):
    name = "ar"
    title = "AR"
    description = "autoregressive"
    objective_path = "model.objectives.ar:AutoregressiveObjective"
    decoder_path = "model.sampling.ar:ARDecoder"
    mask_kind = "causal"
    inference_mask = "causal"
    decoding = "next_token"
    shifted = True
    bound = "exact NLL"
    estimator = "exact NLL"
    exact_likelihood = True
    stock_export = True
    reference_step = "ar_step"

    def named_in_reference(self, text: str) -> bool:
        return bool(re.search(r"(^|[^a-z])ar($|[^a-z])", text)) or "autoregress" in text

    def schedule_fields(self, objective, seq_len: int) -> dict:
        return {"set_size": 1}


SPEC = AutoregressiveFamily()
