"""Checkpoint conversion: the Hugging Face name map used both ways (hf_map), the export's config.json
(hf_config), weight files (hf_files), stock Qwen3/Llama/Mistral directories (hf_stock), the model code
an export ships (hf_code/), the reference implementation's DiT checkpoints (reference), model cards
(card). Pure weight mapping; the `setdlm convert` command that reads and writes run directories is
pretrain/convert/."""

from .errors import ConvertError

__all__ = ["ConvertError"]
