"""`generate`: the Python entry point for every sampler."""

from __future__ import annotations

import torch

from .. import families
from .config import SampleOutput, SamplingConfig, SamplingError
from .engine import to_requests


def decoder_class(family: str):
    """The Decoder class of a family (its FamilySpec's)."""
    return families.get(family, "sampling.family").decoder_class()


def check_context(reqs, spec, limit: int | None) -> None:
    """What must fit in the model's context `limit` (max_seq_len). The cached families decode past it as
    the reference implementation does (each step drops the oldest cache entries, by position, so that
    cache + step fit), but the prompt is prefilled in one forward and must fit; MDLM re-runs the whole
    sequence every step, so prompt and span must fit."""
    if not limit:
        return
    for i, r in enumerate(reqs):
        if spec.rereads_sequence and r.length > limit:
            raise SamplingError(f"generate: prompts[{i}]: {len(r.visible)} prompt tokens + {r.span} new tokens exceed the "
                                f"model's max_seq_len {limit} (MDLM re-reads the whole sequence every step); shorten the "
                                f"prompt or lower max_new_tokens")
        if len(r.visible) > limit:
            raise SamplingError(f"generate: prompts[{i}]: {len(r.visible)} prompt tokens exceed the model's max_seq_len "
                                f"{limit} (decoding past it drops the oldest cached tokens, but the prompt must fit); "
                                f"shorten the prompt")


def generate(model, prompts, config: SamplingConfig | None = None, *, max_batch: int | None = None,
             mask_id: int | None = None,
             eos_id: int | None = None, tokenizer=None, generator: torch.Generator | None = None,
             on_step=None, **overrides) -> list[SampleOutput]:
    """Decode a batch of prompts with the family in `config` (see SamplingConfig).

    prompts: list of token-id lists (generate `max_new_tokens` after each) and/or `Infill`s (fill a
    masked span between a prefix and a suffix). Rows have their own lengths and progress and finish
    independently. mask_id / eos_id default to the model's config and the tokenizer; EOS stops a
    plain prompt unless `config.stop_on_eos` is False. generator (or config.seed) drives sampling when
    temperature > 0. Keyword overrides replace config fields: generate(m, p, window=8, threshold=0.9).
    max_batch: continuous batching with this many slots (config.max_batch; None: all prompts at once);
    outputs are in input order and, greedy, identical to decoding each prompt alone.
    on_step: called with a `StepEvent` (observe.py) for every prompt and step, `row` being the prompt's
    index: what the step committed where, and its window (the decoded tokens are the same without it).
    """
    cfg = SamplingConfig() if config is None else config
    if max_batch is not None:
        overrides["max_batch"] = max_batch
    if overrides:
        import dataclasses

        cfg = dataclasses.replace(cfg, **overrides)
    cfg.validate()
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise SamplingError("generate: the model must hold every layer (pipeline-parallel sampling is not supported)")
    if mask_id is None:
        mask_id = tokenizer.mask_id if tokenizer is not None else model.cfg.mask_id
    if mask_id is None or mask_id < 0:
        raise SamplingError("generate: unknown MASK id (set model.cfg.mask_id or pass mask_id=)")
    if eos_id is None and tokenizer is not None:
        eos_id = getattr(tokenizer, "eos_id", None)
    device = next(model.parameters()).device
    if generator is None and cfg.seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(cfg.seed))
    reqs = to_requests(prompts, cfg, mask_id, model.cfg.vocab_size, eos_id)
    check_context(reqs, cfg.spec, getattr(model.cfg, "max_seq_len", None))
    cls = cfg.spec.decoder_class()  # the family's Decoder
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            dec = cls(model, reqs, cfg, mask_id=mask_id, eos_id=eos_id, tokenizer=tokenizer, generator=generator)
            if on_step is not None:
                from .observe import StepObserver

                dec.observer = StepObserver(dec, on_step)
            return dec.run()
    finally:
        model.train(was_training)
