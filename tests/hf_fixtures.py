"""Tiny stock Hugging Face causal LMs for the init_from tests (model/convert/hf_testing.py)."""

from model.convert.hf_testing import GPT2_ROWS, hf_logits, make_hf_model, write_gpt2_tokenizer  # noqa: F401
