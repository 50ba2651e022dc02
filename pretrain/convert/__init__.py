"""`setdlm convert`: run directories to and from Hugging Face exports and the reference implementation's
checkpoints. The tensor mapping is pure code in model/convert/; these modules read and write run
directories through the checkpoint file layer (pretrain/checkpoint/rundir.py):

- export.py          `to-hf` (setdlm or stock architecture, LoRA merged), `train.export_hf`
- adapter.py         `to-hf --adapter-only`: a LoRA run's PEFT adapter directory
- from_hf.py         `from-hf`, and `write_run` (a run directory holding imported weights)
- from_reference.py  `from-reference`: the reference implementation's DiT checkpoints
- staging.py         an output directory staged and renamed at the end; a full disk as one line
- cli.py             the command line
"""
