"""Sampling engine: KV-cached set decoding for SW-SetDLM and BD3-LM, MDLM and AR decoding, batched
with ragged progress, infilling and stopping. Entry point: `generate`; see docs/sampling.md."""

from .api import generate
from .config import FAMILIES, Infill, SampleOutput, SamplingConfig

__all__ = ["generate", "SamplingConfig", "SampleOutput", "Infill", "FAMILIES"]
