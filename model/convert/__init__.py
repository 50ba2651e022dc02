"""Checkpoint conversion: Hugging Face export format (hf_format, hf_code/), the reference
implementation's DiT checkpoints (reference), model cards (card). Pure weight mapping; the
`setdlm convert` command that reads and writes run directories is pretrain/hf_convert.py."""

from .hf_format import ConvertError

__all__ = ["ConvertError"]
