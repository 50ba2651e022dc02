"""Small pieces every other package may import (nothing here imports the rest of setdlm).

Imports flow ``common -> data_pipeline -> model -> pretrain -> eval -> serve -> launch``:

- ``common.errors``: ``Error``, the base class of every error a user can cause (printed as one line)
- ``common.schema``: typed sections (pydantic dataclasses: the recipe, SamplingConfig, command options) and
  one-line field errors
- ``common.options``: command-line flags, ``--help`` and ``--describe`` generated from a typed options section
- ``common.yamlfile``: reading recipe YAML with errors that name the file and line
- ``common.io``: atomic file writes (temp file, fsync, rename, fsync of the directory)
- ``common.versions``: format versions of saved records, and the step-by-step migration of older ones
- ``common.env``: rank / world size / master address from torchrun, Slurm or MPI variables
- ``common.dist``: the one ``torch.distributed`` process-group initialiser
- ``common.log``: the rank-aware ``setdlm`` logger and the one-line error convention of the CLIs
"""
