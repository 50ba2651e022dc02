"""The modeling and configuration code shipped inside every Hugging Face export (`setdlm convert
to-hf` copies configuration_setdlm.py and modeling_setdlm.py next to the weights). These two files
must stay self-contained: they may import only torch, transformers and each other."""
