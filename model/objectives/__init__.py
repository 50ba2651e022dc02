"""Objectives: one per set-schedule family (AR, MDLM, BD3-LM, SW-SetDLM); each family's spec
(model/families) names its class."""

from .. import families
from .ar import AutoregressiveObjective
from .base import ModelInputs, Objective, summarize
from .bd3lm import BlockDiffusionObjective
from .mdlm import MaskedDiffusionObjective
from .setdlm import SetDiffusionObjective


def build_objective(cfg, model_cfg, seq_len: int, cross_entropy=None) -> Objective:
    """`cross_entropy`: the per-token loss of the model's logits (a tensor-parallel model's
    `model.tp.cross_entropy`; default: over the full vocabulary)."""
    cfg.validate(seq_len)
    return families.get(cfg.name).objective_class()(cfg, model_cfg, seq_len, cross_entropy)


__all__ = ["build_objective", "Objective", "ModelInputs", "summarize", "AutoregressiveObjective",
           "MaskedDiffusionObjective", "BlockDiffusionObjective", "SetDiffusionObjective"]
