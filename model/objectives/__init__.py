"""Objectives: one per set-schedule family (AR, MDLM, BD3-LM, SW-SetDLM); each family's spec
(model/families) names its class."""

from .. import families
from ..context_parallel import check_layout
from .ar import AutoregressiveObjective
from .base import ModelInputs, Objective, summarize
from .bd3lm import BlockDiffusionObjective
from .mdlm import MaskedDiffusionObjective
from .setdlm import SetDiffusionObjective


def build_objective(cfg, model_cfg, seq_len: int, cross_entropy=None, context=None) -> Objective:
    """`cross_entropy`: the per-token loss of the model's logits (a tensor-parallel model's
    `model.tp.cross_entropy`; default: over the full vocabulary). `context`: the model's
    `ContextParallel` (`model.cp`) when sequences are split over CP ranks: `prepare` then gives this
    rank its part of each sequence."""
    cfg.validate(seq_len)
    objective = families.get(cfg.name).objective_class()(cfg, model_cfg, seq_len, cross_entropy)
    if context is not None and context.size > 1:
        family = families.get(cfg.name)
        check_layout(family.mask_kind, seq_len, context.size, cfg.block_size if family.blocked_mask else 0)
        objective.context = context
    return objective


__all__ = ["build_objective", "Objective", "ModelInputs", "summarize", "AutoregressiveObjective",
           "MaskedDiffusionObjective", "BlockDiffusionObjective", "SetDiffusionObjective"]
