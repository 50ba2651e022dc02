"""LoRA adapters of a training checkpoint as a PEFT adapter (adapter_config.json +
adapter_model.safetensors), loadable with `peft.PeftModel.from_pretrained` onto the exported base model.

Our adapters sit on the fused linears (model/lora.py): one A [r, in] and one B [out, r] per fused QKV
and per fused SwiGLU gate/up. PEFT adapts the Hugging Face modules one by one, each with its own A
and B. The fused update `B A x` is exactly the separate updates `B_q A x`, `B_k A x`, `B_v A x` with
B's rows split as hf_map.py splits the weight's rows (per KV-head groups -> q/k/v; interleaved gate/up
rows -> gate/up), so every Hugging Face module gets a copy of A and its rows of B; `lora_alpha / r` is
PEFT's scaling as ours. Names follow PEFT's saved layout:
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`.
"""

from __future__ import annotations

import torch

from .hf_map import hf_names, split

__all__ = ["peft_tensors", "adapter_config", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _module(hf_weight_name: str) -> str:
    return hf_weight_name[: -len(".weight")]


def peft_tensors(weights: dict, model_cfg) -> tuple[dict[str, torch.Tensor], list[str]]:
    """TP=1 weights holding adapters (`....lora.A`, `....lora.B`) -> (PEFT's tensors, the target module
    names, e.g. ["down_proj", "k_proj", ...])."""
    out: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for name in sorted(k for k in weights if k.endswith(".lora.A")):
        module = name[: -len(".lora.A")]
        a, b = weights[name], weights[f"{module}.lora.B"]
        hf = hf_names(f"{module}.weight", model_cfg)
        for hf_name, rows in zip(hf, split(f"{module}.weight", b, model_cfg)):
            key = f"base_model.model.{_module(hf_name)}"
            out[f"{key}.lora_A.weight"] = a.contiguous().clone()
            out[f"{key}.lora_B.weight"] = rows.contiguous().clone()
            targets.add(_module(hf_name).rsplit(".", 1)[1])
    return out, sorted(targets)


def adapter_config(lora: dict, targets: list[str], *, base_model: str | None, task_type: str | None) -> dict:
    """adapter_config.json for `peft` (LoraConfig's fields; the others take PEFT's defaults)."""
    return {"peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model,
            "r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]), "lora_dropout": float(lora.get("dropout", 0.0)),
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": "gaussian", "modules_to_save": None, "inference_mode": True}
