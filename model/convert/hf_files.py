"""Hugging Face weight files: (sharded) safetensors with an index, written and read back, each
problem with a directory named in one line; never a pickle that could run code (a legacy
pytorch_model.bin of an export is read weights-only).

- `write_weights` / `read_weights`: an export directory (ours, tensors in Hugging Face names);
- `weight_files`: the safetensors files of any Hugging Face directory (a stock model's), for lazy
  reads one tensor at a time (hf_stock.HFWeights);
- `read_json`, `parse_size` (`--max-shard-size`), `cast` (`--dtype`), `parameter_total`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from .errors import ConvertError

__all__ = ["SAFE_SINGLE", "SAFE_INDEX", "DTYPES", "write_weights", "read_weights", "weight_files", "read_json",
           "parse_size", "cast", "parameter_total"]

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2) or "B").upper() if m else ""
    if not m or unit not in _UNITS:
        raise ConvertError(f"--max-shard-size: cannot read {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[unit])


def write_weights(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> list[str]:
    """Write model.safetensors, or model-0000i-of-0000n.safetensors + an index when the tensors are
    larger than `max_shard_bytes` (a tensor larger than the limit gets a shard of its own)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    umask = os.umask(0)
    os.umask(umask)

    def save(tensors_, name):
        save_file(tensors_, str(out_dir / name), metadata={"format": "pt"})
        os.chmod(out_dir / name, 0o666 & ~umask)  # safetensors creates files readable by the owner only

    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    if total <= max_shard_bytes:
        save(tensors, SAFE_SINGLE)
        return [SAFE_SINGLE]
    shards: list[list[str]] = [[]]
    used = 0
    for k in tensors:
        if shards[-1] and used + sizes[k] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += sizes[k]
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for name, keys in zip(names, shards):
        save({k: tensors[k] for k in keys}, name)
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise ConvertError(f"{path.parent}: weight file {path.name} is missing (incomplete export?)")
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several error types
        raise ConvertError(f"{path}: not a readable safetensors file, the export is corrupt or truncated "
                           f"({type(e).__name__}: {e})") from None


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConvertError(f"{path.parent}: {path.name} is missing ({what})")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path}: not valid JSON, the file is corrupt ({e})") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return data


def _shards(d: Path) -> dict[str, list[str]]:
    """Shard file name -> the tensors the index of `d` lists in it; every shard checked present."""
    index = d / SAFE_INDEX
    weight_map = read_json(index, "the shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConvertError(f"{index}: no weight_map, the index is corrupt")
    shards: dict[str, list[str]] = {}
    for k, f in weight_map.items():
        shards.setdefault(f, []).append(k)
    for f in sorted(shards):
        if not (d / f).is_file():
            raise ConvertError(f"{d}: weight file {f} named in {SAFE_INDEX} is missing (incomplete export?)")
    return dict(sorted(shards.items()))


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an export directory (single file or sharded with an index)."""
    d = Path(model_dir)
    if (d / SAFE_INDEX).is_file():
        out: dict[str, torch.Tensor] = {}
        for shard, listed in _shards(d).items():
            tensors = _load_file(d / shard)
            absent = sorted(set(listed) - set(tensors))
            if absent:
                raise ConvertError(f"{d / shard}: tensor {absent[0]!r} listed in the index is not in the shard")
            out.update(tensors)
        return out
    if (d / SAFE_SINGLE).is_file():
        return _load_file(d / SAFE_SINGLE)
    if (d / "pytorch_model.bin").is_file():
        try:
            try:  # mapped, not read into memory: a whole model (a legacy, non-zip file cannot be mapped)
                return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            if "Unsupported global" in str(e) or "Can only build" in str(e):
                raise ConvertError(f"{d / 'pytorch_model.bin'}: refused: it holds Python objects that would run code "
                                   "when loaded (weights only are read)") from None
            raise ConvertError(f"{d / 'pytorch_model.bin'}: unreadable ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:160] if str(e) else 'truncated'})") from None
    raise ConvertError(f"{d}: no weights ({SAFE_SINGLE}, {SAFE_INDEX} or pytorch_model.bin); incomplete export?")


def weight_files(d) -> list[Path]:
    """The safetensors files of a Hugging Face directory (single file or the shards its index names);
    pickle weights are refused (they can execute code when loaded)."""
    d = Path(d)
    if (d / SAFE_INDEX).is_file():
        return [d / f for f in _shards(d)]
    if (d / SAFE_SINGLE).is_file():
        return [d / SAFE_SINGLE]
    if any(d.glob("*.bin")) or any(d.glob("*.pt")):
        raise ConvertError(f"{d}: only pickle weights (*.bin / *.pt), which can execute code when loaded; convert "
                           "them to safetensors first (transformers: model.save_pretrained(dir, safe_serialization=True))")
    raise ConvertError(f"{d}: no weights ({SAFE_SINGLE} or {SAFE_INDEX})")


def cast(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    to = DTYPES[dtype]
    return {k: (v.to(to) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def parameter_total(tensors: dict[str, torch.Tensor]) -> int:
    return int(sum(t.numel() for t in tensors.values()))
