"""`setdlm convert`: Hugging Face export/import of training checkpoints (docs/convert.md)."""

from __future__ import annotations


def export_at_end(run_dir) -> str:
    """Export the run's latest checkpoint to RUN/hf (train.export_hf); returns a log line."""
    return f"(train.export_hf: the Hugging Face exporter is not available yet; run `setdlm convert to-hf --checkpoint {run_dir}` later)"


def main(argv=None) -> int:
    raise SystemExit("setdlm convert: not available yet")
