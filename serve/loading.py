"""The model being served: loaded once from a checkpoint, with what requests are checked against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Served:
    model: object
    tokenizer: object
    recipe: object
    name: str  # the id clients pass as `model`
    max_len: int  # positions the model was trained on: a prompt must fit (MDLM: prompt + new tokens)
    s_max: int | None  # SW-SetDLM: the widest set it was trained on (the window's upper limit)
    mask_id: int
    eos_id: int | None
    max_total: int = 0  # prompt + new tokens of one output (the cached families decode past max_len); 0: max_len
    chat: object = None  # the tokenizer's ChatTemplate once checked (None: the plain format; params.chat_template)
    chat_error: str | None = None  # why the chat template failed its check (chat requests are then refused)
    chat_checked: bool = False


def load_served(checkpoint: str | Path, *, name: str | None = None, device: str | None = None,
                dtype: str = "fp32", ema: bool = True, max_total: int | None = None) -> Served:
    """Load a run or checkpoint directory for serving (the loader and tokenizer `setdlm sample` uses).
    `max_total`: the most prompt + new tokens of one output (default: twice max_seq_len)."""
    from common.errors import UsageError
    from pretrain.checkpoint.rundir import split_selector

    base, _ = split_selector(checkpoint)  # RUN:best, RUN:latest, RUN:STEP name a run that exists
    if not base.exists():
        raise UsageError(f"--checkpoint {checkpoint}: no such directory")
    path = Path(checkpoint)
    import torch

    from pretrain.checkpoint.inference import load_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, recipe = load_model(path, ema=ema, device=device)
    model = model.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]).eval()
    obj = recipe.objective
    s_max = obj.family.served_s_max(obj)
    run = base.resolve()
    if run.parent.name == "checkpoints":  # a checkpoint directory: name the run it belongs to
        run = run.parent.parent
    return Served(model=model, tokenizer=tokenizer, recipe=recipe, name=name or run.name,
                  max_len=int(model.cfg.max_seq_len), s_max=s_max, mask_id=int(tokenizer.mask_id),
                  eos_id=getattr(tokenizer, "eos_id", None),
                  max_total=int(max_total or 2 * model.cfg.max_seq_len))
