"""`setdlm convert to-hf --adapter-only`: a LoRA run's adapters as a PEFT adapter directory.

    setdlm convert to-hf --checkpoint RUN --out base --base-only      # the frozen base model
    setdlm convert to-hf --checkpoint RUN --out adapter --adapter-only

    base = AutoModelForCausalLM.from_pretrained("base")                 # a stock export (AR); else
    # AutoModelForMaskedLM.from_pretrained("base", trust_remote_code=True) for the set-diffusion families
    model = peft.PeftModel.from_pretrained(base, "adapter")            # == the merged export

The directory holds adapter_config.json, adapter_model.safetensors (model/convert/peft_adapter.py maps
the fused adapters onto PEFT's per-module ones), the tokenizer and a README. `base_model_name_or_path`
names the run's `train.init_from` when that is a Hugging Face directory (for an AR run from a stock
model the adapter loads onto it as well, the vocabulary aside: the run's has MASK added).
"""

from __future__ import annotations

import json
from pathlib import Path

from model.convert.errors import ConvertError
from model.convert.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, peft_tensors
from model.lora import is_adapter

__all__ = ["split_adapters", "adapter_files", "write_adapter_files"]


def split_adapters(weights: dict, cfg, ckpt, flag: str) -> tuple[dict, dict]:
    """(base weights, adapter weights) of an unmerged LoRA checkpoint; a ConvertError naming `flag` when
    the checkpoint has no adapters."""
    adapters = {k: v for k, v in weights.items() if is_adapter(k)}
    if not adapters or cfg.train.lora is None:
        raise ConvertError(f"{flag}: checkpoint {ckpt} was not trained with train.lora (it has no adapters); "
                           "export it without the flag")
    return {k: v for k, v in weights.items() if not is_adapter(k)}, adapters


def adapter_files(adapters: dict, cfg, *, name: str, meta: dict, used_ema: bool, model_type: str | None) -> dict:
    """What the adapter directory holds (see the module doc): {"tensors": PEFT tensors, "config":
    adapter_config.json, "readme": README.md, "targets": the PEFT target modules}."""
    lora = cfg.train.lora
    tensors, targets = peft_tensors({k: v.float() for k, v in adapters.items()}, cfg.model)
    src = cfg.train.init_from
    base = str(src) if src and (Path(str(src)) / "config.json").is_file() else None
    config = adapter_config({"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout}, targets,
                            base_model=base, task_type="CAUSAL_LM" if model_type else None)
    readme = "\n".join([
        f"# {name} (LoRA adapter)", "",
        f"PEFT LoRA adapter (rank {lora.rank}, alpha {lora.alpha:g}, on {', '.join(targets)}) of `{cfg.run.name}` "
        f"step {meta.get('step')} ({'EMA' if used_ema else 'raw'} weights), written by `setdlm convert to-hf "
        "--adapter-only`.", "",
        "Load it onto the run's base model, `setdlm convert to-hf --checkpoint RUN --base-only --out BASE`:", "",
        "```python", "import peft",
        ("from transformers import AutoModelForCausalLM\nbase = AutoModelForCausalLM.from_pretrained(BASE)" if model_type
         else "from transformers import AutoModelForMaskedLM\n"
              "base = AutoModelForMaskedLM.from_pretrained(BASE, trust_remote_code=True)"),
        'model = peft.PeftModel.from_pretrained(base, "PATH_TO_THIS_DIRECTORY")',
        "model = model.merge_and_unload()  # optional: the merged export's weights", "```", ""])
    return {"tensors": tensors, "config": config, "readme": readme, "targets": targets}


def write_adapter_files(files: dict, d: Path) -> None:
    """Write `adapter_files`' result into directory `d` (the caller's staging directory)."""
    from safetensors.torch import save_file

    save_file(files["tensors"], str(Path(d) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (Path(d) / ADAPTER_CONFIG).write_text(json.dumps(files["config"], indent=2) + "\n")
    (Path(d) / "README.md").write_text(files["readme"])
